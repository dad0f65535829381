"""KV delivery throughput of `--transport mooncake` (Mooncake Transfer Engine, TCP protocol) vs tcp vs shm.

    .venv/bin/python benchmarks/bench_mooncake_transfer.py [--prompt-tokens 1024] [--requests 16] [--repeats 3]
        [--netns]   (root and iproute2: also across two network namespaces joined by a veth pair)

The path of `benchmarks/bench_transfer.py` (`delivery`): two processes, one like a prefill worker handing each
layer's blocks of a prompt to its sender as views into its KV pool, one like a decode worker writing each chunk
into the reserved blocks of its own pool and verifying it; throughput = KV bytes delivered / (first send .. last
block written), after four untimed warm-up prompts. Rows, interleaved per repeat (so a noisy moment on a shared
host hits every row alike), medians reported:

    loopback             a plain TCP socket between two processes (`loopback_ceiling`): the kernel's ceiling
    engine               the transfer engine alone (`engine_ceiling`): one process writes chunk-sized pieces into
                         another's registered 256 MiB region, `transfer_sync_write` after `transfer_sync_write`,
                         walking a 256 MiB region of its own: mooncake's ceiling (no copy, no checksum, no header)
    shm, tcp, mooncake   the default label (internal): plain on one host
    tcp_secret, mooncake_secret   label secret: AES-256-GCM before the bytes leave the sender (aead)
    --netns: tcp_netns, mooncake_netns (internal across hosts: aead), *_public_netns (public: mac), and the
             veth's own socket ceiling, the receiver in the second namespace

Writes bench_results/mooncake_transfer.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transfer import (BLOCK, HEAD_DIM, KV_HEADS, LAYERS, REGION, delivery, enter_netns,  # noqa: E402
                            loopback_ceiling)

# row -> None (the socket), "engine" (the engine alone) or (transport, label)
LOCAL = {"loopback": None, "engine": "engine", "shm": ("shm", None), "tcp": ("tcp", None),
         "mooncake": ("mooncake", None), "tcp_secret": ("tcp", "secret"), "mooncake_secret": ("mooncake", "secret")}
ACROSS = {"loopback_netns": None, "engine_netns": "engine", "tcp_netns": ("tcp", None),
          "mooncake_netns": ("mooncake", None), "tcp_public_netns": ("tcp", "public"),
          "mooncake_public_netns": ("mooncake", "public")}


def _engine_target(host: str, netns: str | None, q: mp.Queue, bye: mp.Queue) -> None:
    enter_netns(netns)
    from pdserve.transfer.mooncake import Region, engine
    te, segment = engine(host, "tcp")
    region = Region(te, REGION)
    region.view[:] = bytes(REGION)  # (touched: no page faults timed, as in a pool in use)
    q.put((segment, region.addr))
    bye.get()


def engine_ceiling(chunk: int, total: int, host: str = "127.0.0.1", netns: str | None = None) -> float:
    """The transfer engine's own rate: `total` bytes written in `chunk`-sized one-sided writes to a process on
    `host` (in network namespace `netns`), one after another."""
    from pdserve.transfer.mooncake import Region, _local_host, engine
    ctx = mp.get_context("spawn")
    q, bye = ctx.Queue(), ctx.Queue()
    target = ctx.Process(target=_engine_target, args=(host, netns, q, bye))
    target.start()
    segment, base = q.get()
    te, _ = engine(_local_host(host), "tcp")
    src = Region(te, REGION)
    src.view[:] = bytes(REGION)
    size = (REGION // chunk) * chunk
    te.transfer_sync_write(segment, src.addr, base, chunk)  # (the connection, untimed)
    start = time.perf_counter()
    for sent in range(0, total, chunk):
        if te.transfer_sync_write(segment, src.addr + sent % size, base + sent % size, chunk) != 0:
            raise SystemExit(f"engine write to {segment} failed")
    rate = total / (time.perf_counter() - start)
    bye.put(1)
    target.join()
    src.close()
    return rate


def _row(what, chunk: int, total: int, args, blocks: int, host: str = "127.0.0.1", netns: str | None = None):
    if what is None:
        return loopback_ceiling(chunk, total, False, host, netns)
    if what == "engine":
        return engine_ceiling(chunk, total, host, netns)
    return delivery(what[0], args.requests, blocks, host, netns, what[1])[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--netns", action="store_true")
    args = ap.parse_args()
    from pdserve.mooncake import unavailable
    if (why := unavailable()) is not None:
        raise SystemExit(why)
    blocks = args.prompt_tokens // BLOCK
    chunk = 2 * KV_HEADS * blocks * BLOCK * HEAD_DIM * 4
    total = chunk * LAYERS * args.requests
    rows = {name: [] for name in (*LOCAL, *(ACROSS if args.netns else {}))}
    with ExitStack() as stack:
        ns = None
        if args.netns:
            from pdserve.bench.netns import netns
            ns = stack.enter_context(netns())
        for _ in range(args.repeats):
            for name, what in LOCAL.items():
                rows[name].append(_row(what, chunk, total, args, blocks))
            for name, what in (ACROSS.items() if ns else ()):
                rows[name].append(_row(what, chunk, total, args, blocks, ns.peer_ip, ns.name))
            print({k: f"{v[-1] / 1e9:.2f}" for k, v in rows.items()}, flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"chunk {chunk / 2**20:.2f} MiB (one layer of {args.prompt_tokens} tokens), {total / 2**20:.0f} MiB per "
          f"run, median of {args.repeats}")
    print(f"{'path':<24}{'GB/s':>8}{'vs tcp':>9}{'vs socket':>11}{'vs engine':>11}")
    for name, m in med.items():
        ns = "_netns" if name.endswith("_netns") else ""
        tcp, ceiling, engine = med["tcp" + ns], med["loopback" + ns], med["engine" + ns]
        print(f"{name:<24}{m / 1e9:>8.2f}{m / tcp:>9.0%}{m / ceiling:>11.0%}{m / engine:>11.0%}")
    out = Path("bench_results")
    out.mkdir(exist_ok=True)
    (out / "mooncake_transfer.json").write_text(json.dumps({"args": vars(args), "chunk_bytes": chunk, "runs": rows,
                                                            "median": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
