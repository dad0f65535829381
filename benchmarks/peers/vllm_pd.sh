#!/usr/bin/env bash
# vLLM-CPU's own 1P1D disaggregation (MooncakeConnector over TCP) behind one OpenAI endpoint, foreground.
#
#   benchmarks/peers/vllm_pd.sh [PORT] [MODEL_DIR]
#
# Starts a prefill `vllm serve` (kv_producer, port 8011, core 0) and a decode one (kv_consumer, port 8012,
# core 1) on pdserve's exported weights, both --block-size 32 as the connector needs, then the proxy
# (benchmarks/peers/vllm_pd_proxy.py, pdserve's venv) on PORT (default 8001) that sends every request to
# both. Needs, once: `$PEER/vllm/bin/pip install mooncake-transfer-engine-non-cuda`,
# `apt-get install -y libibverbs1`, `$PEER/vllm/bin/python benchmarks/peers/patch_vllm_mooncake.py`.
# Ready when GET http://127.0.0.1:PORT/v1/models answers (both servers compile for 1.5-3 min).
# Ctrl-C / SIGTERM stops all three.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEER="${PEER:-/work/peers}"
SHARED="${SHARED:-$(dirname "$REPO")/shared/peers}"
PORT="${1:-8001}"
MODEL_DIR="${2:-$PEER/smollm2-hf}"
PY="$PEER/vllm/bin/python"
BOOT=8998

"$PY" -c "import mooncake.engine" 2>/dev/null || {
    echo "vllm_pd.sh: the Mooncake transfer engine is missing; see the header of this script" >&2; exit 1; }
[[ -d "$MODEL_DIR" ]] || "$REPO/.venv/bin/pdserve" export-hf --output "$MODEL_DIR"
source "$SHARED/env.sh"
export VLLM_CPU_NUM_OF_RESERVED_CPU=0

serve() {  # role port core engine_id
    local cfg="{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"$1\",\"engine_id\":\"$4\",\"kv_connector_extra_config\":{\"mooncake_protocol\":\"tcp\"}}"
    VLLM_CPU_OMP_THREADS_BIND="$3" VLLM_MOONCAKE_BOOTSTRAP_PORT=$BOOT \
        "$PY" "$SHARED/vllm_cli.py" serve "$MODEL_DIR" --served-model-name SmolLM2-135M-Instruct \
        --host 127.0.0.1 --port "$2" --dtype float32 --max-model-len 2048 --block-size 32 \
        --kv-transfer-config "$cfg" &
}
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
serve kv_producer 8011 0 prefill0; pids+=($!)
serve kv_consumer 8012 1 decode0; pids+=($!)
"$REPO/.venv/bin/python" "$REPO/benchmarks/peers/vllm_pd_proxy.py" --prefill http://127.0.0.1:8011 \
    --decode http://127.0.0.1:8012 --bootstrap "http://127.0.0.1:$BOOT" --port "$PORT" &
pids+=($!)
echo "vllm_pd.sh: 1P1D on http://127.0.0.1:$PORT (prefill :8011 core 0, decode :8012 core 1)" >&2
wait -n
