"""Wake-up cost: how much longer an engine's step takes after the engine sat idle for a while.

    .venv/bin/python benchmarks/bench_wake.py [--gaps 0.25,0.5,2,8,16] [--repeats 2]

One engine (the default model, one torch thread, as a PD worker runs) in this process. For each gap:
two 16-token prefill-only steps back to back (the second is the warm reference), sleep `gap` seconds,
one more such step; extra = that step - the warm one. Median over repeats, in ms. This is the effect the
simulator's wake-up tables model (`pdserve.sim.timemodel`); `bench_fidelity.py` measures the tables on the
real server, where they come out smaller.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gaps", default="0.25,0.5,2,8,16")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm import build_engine
    from pdserve.engine.profiler import _prefill_step
    torch.set_num_threads(1)
    engine = build_engine(EngineConfig(num_threads=1, enable_prefix_caching=False))
    salt = 0
    for _ in range(3):
        salt += 1
        _prefill_step(engine, 16, salt)
    print(f"{'idle s':>7}{'warm ms':>10}{'after idle ms':>15}{'extra ms':>10}")
    for gap in (float(g) for g in args.gaps.split(",")):
        warm, woken = [], []
        for _ in range(args.repeats):
            _prefill_step(engine, 16, salt + 1)
            warm.append(_prefill_step(engine, 16, salt + 2))
            time.sleep(gap)
            woken.append(_prefill_step(engine, 16, salt + 3))
            salt += 3
        w, x = statistics.median(warm) * 1000, statistics.median(woken) * 1000
        print(f"{gap:>7g}{w:>10.0f}{x:>15.0f}{x - w:>10.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
