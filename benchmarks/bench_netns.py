"""tcp KV delivery across two network namespaces joined by a veth pair, against a plain socket over the same veth.

    sudo .venv/bin/python benchmarks/bench_netns.py [--prompt-tokens 1024] [--requests 16] [--repeats 3]

The setup of `tests/test_netns_serve.py` (the decode worker's namespace, a veth with addresses of its own),
and the two measurements of `bench_transfer.py` with the receiving process moved into that namespace: `veth`
is a plain TCP socket (`sendall` / `recv_into` of chunk-sized pieces walking 256 MiB regions), `tcp` the
tcp transport on the workers' own path (blocks `sendmsg`'d from one KV pool, `recvmsg_into` another,
checksummed). Also the same pair over loopback in one namespace, for the veth's own cost. Needs root.
Writes bench_results/netns.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

from bench_transfer import BLOCK, HEAD_DIM, KV_HEADS, LAYERS, delivery, loopback_ceiling


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def make_netns(tag: str) -> tuple[str, str, str]:
    ns, here, there = f"pdbench{tag}", f"pbh{tag}", f"pbw{tag}"
    _ip("netns", "add", ns)
    _ip("link", "add", here, "type", "veth", "peer", "name", there)
    _ip("link", "set", there, "netns", ns)
    _ip("addr", "add", "10.250.7.1/24", "dev", here)
    _ip("link", "set", here, "up")
    _ip("-n", ns, "addr", "add", "10.250.7.2/24", "dev", there)
    _ip("-n", ns, "link", "set", there, "up")
    _ip("-n", ns, "link", "set", "lo", "up")
    return ns, here, "10.250.7.2"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    blocks = args.prompt_tokens // BLOCK
    chunk = 2 * KV_HEADS * blocks * BLOCK * HEAD_DIM * 4
    total = chunk * LAYERS * args.requests
    ns, link, peer = make_netns(str(os.getpid() % 10000))
    rows = {"veth": [], "tcp_veth": [], "loopback": [], "tcp_loopback": []}
    try:
        for _ in range(args.repeats):  # interleaved: drift on a shared machine hits all alike
            rows["veth"].append(loopback_ceiling(chunk, total, hot=False, host=peer, netns=ns))
            rows["tcp_veth"].append(delivery("tcp", args.requests, blocks, host=peer, netns=ns)[0])
            rows["loopback"].append(loopback_ceiling(chunk, total, hot=False))
            rows["tcp_loopback"].append(delivery("tcp", args.requests, blocks)[0])
    finally:
        subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"chunk {chunk / 2**20:.2f} MiB, {total / 2**20:.0f} MiB per run, median of {args.repeats}")
    for name, ceiling in (("veth", None), ("tcp_veth", "veth"), ("loopback", None), ("tcp_loopback", "loopback")):
        ratio = f"{med[name] / med[ceiling]:.0%} of {ceiling}" if ceiling else ""
        print(f"{name:<14}{med[name] / 1e9:>7.2f} GB/s  {ratio}")
    out = Path("bench_results")
    out.mkdir(exist_ok=True)
    (out / "netns.json").write_text(json.dumps({"args": vars(args), "chunk_bytes": chunk, "runs": rows,
                                                "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
