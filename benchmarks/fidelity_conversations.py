"""The second fidelity workload (issue 42): multi-turn conversations of the Mooncake conversation trace, so
prompts reuse earlier turns' KV, written as a Mooncake JSONL that `bench_fidelity.py` replays on the real server
and in the simulator alike (the conversations among the trace's first --window requests with the turns they
extend: `bench_kv_tiers.select_trace`).

    .venv/bin/python benchmarks/fidelity_conversations.py [--window 300] [--output bench_results/conversations.jsonl]
    .venv/bin/python benchmarks/bench_fidelity.py --workload mooncake:bench_results/conversations.jsonl \\
        --length-scale 0.03125 --max-requests 41 --num-kv-blocks 256 --kv-host-gb 0.5 --output bench_results/fidelity_mc
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kv_tiers as kvt  # noqa: E402 - beside this script (trace selection)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=300, help="the trace's first N requests to select from")
    ap.add_argument("--output", type=Path, default=Path("bench_results/conversations.jsonl"))
    args = ap.parse_args()
    records = kvt.select_trace(args.window, "conversations", 0)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    kvt.write_trace(records, args.output)
    seen: set = set()
    reused = 0
    for r in records:
        reused += kvt.leading_seen(r["hash_ids"], seen)
        seen.update(r["hash_ids"])
    print(f"wrote {args.output}: {len(records)} requests, {reused / sum(len(r['hash_ids']) for r in records):.0%} "
          f"of their blocks a prefix seen before")
    return 0


if __name__ == "__main__":
    sys.exit(main())
