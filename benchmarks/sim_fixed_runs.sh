#!/usr/bin/env bash
# Fixed `pdserve simulate` runs for refactors that must not change behaviour: run before and after a change
# and compare the printed hashes (result.json with wall time, speedup and the run's label left out).
#   bash benchmarks/sim_fixed_runs.sh OUTDIR       (from the repo root; traces from $PDSERVE_TRACES)
# a: PD 2P+2D, int8 KV, host + disk tiers, service-tier mix, injected transfer failures, TTFT timeouts;
# b: 1P+2D, decode cadence steady, host tier, aborts by TTFT timeout, production paced by a 5 Gbit/s link;
# c: 2P+1D, --delivery fifo, injected failures, timeouts.
set -euo pipefail
OUT=${1:?usage: sim_fixed_runs.sh OUTDIR}
TRACES=${PDSERVE_TRACES:-$(cd "$(dirname "$0")/../.." && pwd)/shared/traces}
TRACE=mooncake:$TRACES/mooncake_conversation_trace.jsonl
SIM=(.venv/bin/pdserve simulate --no-progress --workload "$TRACE" --max-input-len 7000 --model llama-3-8b --gpu h100)
mkdir -p "$OUT"
"${SIM[@]}" --max-requests 300 --time-scale 0.5 --prefill 2 --decode 2 --link-gbps 10 \
  --tier-mix priority=0.2,default=0.6,flex=0.2 --kv-cache-dtype int8 --kv-host-gb 4 --kv-disk-gb 8 \
  --num-kv-blocks 3000 --transfer-failure-rate 0.05 --ttft-timeout-s 20 --control-latency-ms 0.5 \
  --output "$OUT/a" > "$OUT/a.log" 2>&1
"${SIM[@]}" --max-requests 300 --time-scale 0.15 --prefill 1 --decode 2 --link-gbps 5 \
  --tier-mix priority=0.3,default=0.4,flex=0.3 --decode-cadence steady --ttft-timeout-s 6 \
  --num-kv-blocks 2000 --kv-host-gb 2 --output "$OUT/b" > "$OUT/b.log" 2>&1
"${SIM[@]}" --max-requests 200 --time-scale 0.4 --prefill 2 --decode 1 --link-gbps 8 --delivery fifo \
  --num-kv-blocks 2500 --kv-host-gb 2 --transfer-failure-rate 0.05 --ttft-timeout-s 10 \
  --output "$OUT/c" > "$OUT/c.log" 2>&1
for run in a b c; do
  .venv/bin/python - "$OUT/$run/result.json" "$run" <<'PY'
import hashlib, json, sys
def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k != "label" and not any(w in k for w in ("wall", "speedup", "elapsed"))}
    return [strip(v) for v in x] if isinstance(x, list) else x
text = json.dumps(strip(json.load(open(sys.argv[1]))), sort_keys=True)
print(sys.argv[2], hashlib.sha256(text.encode()).hexdigest()[:16])
PY
done
