"""tcp KV delivery throughput by protection mode: plain vs mac vs aead (issue 40 item 2).

    .venv/bin/python benchmarks/bench_kv_seal.py [--mib 256] [--chunk-kib 256 4096] [--runs 5] \
        [--link-mbit 1000 10000]

A real `TcpSender` in this process and a real `TcpReceiver` in a child process: the sender sends `--mib` MiB
of KV-sized chunks (one buffer, as a KV pool's views) and a closing record; the receiver writes each chunk's
payload into a reused pool-sized buffer (`place`, as a decode worker does) and reports when the closing record
arrived. Throughput = bytes / (closing record received - first timed send), median of `--runs`, every mode
side by side in one run (interleaved). Modes by label and path (`pdserve.core.pd.sensitivity`): plain =
internal on one host; mac = public across hosts; aead = internal across hosts.

Links: `loopback` (always) and, per `--link-mbit` rate, the receiver in a network namespace behind a veth pair
shaped with `tc tbf` on the KV's way (`pdserve.bench.netns`; needs root and iproute2). On each link every mode is
run: the benchmark sets both ends' idea of "across hosts" itself (plain on the veth is the baseline that no
label gets there in a deployment).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack

MODES = {"plain": ("internal", False), "mac": ("public", True), "aead": ("internal", True)}


def receiver_main(host: str, chunk: int, cross: bool) -> None:
    """The child: a receiver on `host`; prints its address, then `done <monotonic>` per closing record."""
    from pdserve.transfer import tcp
    from pdserve.transfer.tcp import TcpReceiver
    tcp.crosses_hosts = lambda peer: cross  # (the benchmark's own: plain on a veth is the baseline)
    receiver = TcpReceiver(host)
    pool = memoryview(bytearray(chunk))
    print(receiver.address, flush=True)
    while True:
        for msg in receiver.poll(1, lambda header: [pool[:header["nbytes"]]]):
            kind = msg.header.get("kind")
            if kind == "chunk" and not msg.verified:
                print("bad", flush=True)
            elif kind == "done":
                print(f"done {time.monotonic()}", flush=True)
            elif kind == "stop":
                return


def run(mode: str, chunk: int, total: int, host: str, prefix: list[str]) -> float:
    """GB/s of one run."""
    label, cross = MODES[mode]
    from pdserve.transfer import tcp
    from pdserve.transfer.tcp import TcpSender
    tcp.crosses_hosts = lambda peer: cross  # this benchmark's own: each mode on every link (plain as baseline)
    child = subprocess.Popen([*prefix, sys.executable, __file__, "--receiver", host, str(chunk), str(int(cross))],
                             stdout=subprocess.PIPE, text=True)
    try:
        address = child.stdout.readline().strip()
        sender = TcpSender(timeout_s=60.0)
        payload = memoryview(os.urandom(chunk))
        header = {"kind": "chunk", "xfer": "bench", "layer": 0, "first": 0, "count": 1, "label": label}
        sender.send_chunk(address, header, [payload])  # connect, hello and its reply: not timed
        start = time.monotonic()
        for _ in range(total // chunk):
            sender.send_chunk(address, header, [payload])
        sender.send_control(address, {"kind": "done", "xfer": "bench"})
        line = child.stdout.readline().split()
        if line[0] != "done":
            raise RuntimeError(f"a chunk failed its check ({mode})")
        sender.send_control(address, {"kind": "stop"})
        assert sender.protected_bytes[mode] == (total // chunk + 1) * chunk
        sender.close()
        return (total // chunk) * chunk / (float(line[1]) - start) / 1e9
    finally:
        child.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--chunk-kib", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--link-mbit", type=float, nargs="*", default=[])
    ap.add_argument("--receiver", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receiver:
        return receiver_main(args.receiver[0], int(args.receiver[1]), args.receiver[2] == "1")
    os.environ["PDSERVE_DEPLOYMENT_SECRET"] = secrets.token_hex(32)  # both processes' deployment
    print(f"{'link':>14} {'chunk':>9} {'mode':>6} {'GB/s (median)':>14} {'vs plain':>9}  runs")
    for link in ["loopback", *args.link_mbit]:
        with ExitStack() as stack:
            host, prefix = "127.0.0.1", []
            if link != "loopback":
                from pdserve.bench.netns import netns
                ns = stack.enter_context(netns())
                ns.shape(link)
                host, prefix, link = ns.peer_ip, ns.exec_argv([]), f"tbf {link:g} Mbit"
            for kib in args.chunk_kib:
                table(link, kib, args, host, prefix)


def table(link: str, kib: int, args, host: str, prefix: list[str]) -> None:
    results: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.runs):  # interleaved, so a noisy moment hits every mode alike
        for mode in MODES:
            results[mode].append(run(mode, kib << 10, args.mib << 20, host, prefix))
    plain = statistics.median(results["plain"])
    for mode, values in results.items():
        med = statistics.median(values)
        print(f"{link:>14} {kib:>5} KiB {mode:>6} {med:>14.3f} {med / plain:>8.0%}  "
              f"{' '.join(f'{v:.3f}' for v in values)}", flush=True)


if __name__ == "__main__":
    main()
