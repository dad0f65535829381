"""tcp KV delivery throughput by protection mode: plain vs mac vs aead (issue 40 item 2).

    .venv/bin/python benchmarks/bench_kv_seal.py [--mib 512] [--chunk-kib 256 4096] [--runs 5]

A real `TcpSender` in this process and a real `TcpReceiver` in a child process, over loopback: the sender sends
`--mib` MiB of KV-sized chunks (one buffer, as a KV pool's views) and a closing record; the receiver writes
each chunk's payload into a reused pool-sized buffer (`place`, as a decode worker does) and reports when the
closing record arrived. Throughput = bytes / (closing record received - first send), median of `--runs`, for
each chunk size and mode side by side in one run. Modes by label and path (`pdserve.core.pd.sensitivity`):
plain = internal on one host; mac = public across hosts; aead = internal across hosts. Across hosts is
forced on loopback with the test-only `PDSERVE_KV_CROSS_HOST=always` in both processes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

MODES = {"plain": ("internal", False), "mac": ("public", True), "aead": ("internal", True)}


def _receive(cross: bool, chunk: int, conn) -> None:
    if cross:
        os.environ["PDSERVE_KV_CROSS_HOST"] = "always"
    from pdserve.transfer.tcp import TcpReceiver
    receiver = TcpReceiver()
    pool = memoryview(bytearray(chunk))
    conn.send(receiver.address)
    while True:
        for msg in receiver.poll(1, lambda header: [pool[:header["nbytes"]]]):
            kind = msg.header.get("kind")
            if kind == "chunk" and not msg.verified:
                conn.send(("bad", time.monotonic()))
            elif kind == "done":
                conn.send(("done", time.monotonic()))
            elif kind == "stop":
                receiver.close()
                return


def run(mode: str, chunk: int, total: int) -> float:
    """GB/s of one run."""
    label, cross = MODES[mode]
    if cross:
        os.environ["PDSERVE_KV_CROSS_HOST"] = "always"
    else:
        os.environ.pop("PDSERVE_KV_CROSS_HOST", None)
    from pdserve.transfer.tcp import TcpSender
    ours, theirs = mp.Pipe()
    child = mp.get_context("fork").Process(target=_receive, args=(cross, chunk, theirs), daemon=True)
    child.start()
    address = ours.recv()
    sender = TcpSender(timeout_s=30.0)
    payload = memoryview(os.urandom(chunk))
    header = {"kind": "chunk", "xfer": "bench", "layer": 0, "first": 0, "count": 1, "label": label}
    sender.send_chunk(address, header, [payload])  # connect, hello and its reply: not timed
    start = time.monotonic()
    for _ in range(total // chunk):
        sender.send_chunk(address, header, [payload])
    sender.send_control(address, {"kind": "done", "xfer": "bench"})
    kind, at = ours.recv()
    if kind != "done":
        raise RuntimeError(f"a chunk failed its check ({mode})")
    sender.send_control(address, {"kind": "stop"})
    child.join(10)
    sender.close()
    assert sender.protected_bytes[mode] == (total // chunk + 1) * chunk
    return (total // chunk) * chunk / (at - start) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--chunk-kib", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    print(f"{'chunk':>9} {'mode':>6} {'GB/s (median)':>14} {'vs plain':>9}  runs")
    for kib in args.chunk_kib:
        results: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.runs):  # interleaved, so a noisy moment hits every mode alike
            for mode in MODES:
                results[mode].append(run(mode, kib << 10, args.mib << 20))
        plain = statistics.median(results["plain"])
        for mode, values in results.items():
            med = statistics.median(values)
            print(f"{kib:>6} KiB {mode:>6} {med:>14.2f} {med / plain:>8.0%}  "
                  f"{' '.join(f'{v:.2f}' for v in values)}")


if __name__ == "__main__":
    main()
