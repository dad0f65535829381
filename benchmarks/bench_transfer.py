"""KV delivery throughput of the shm and tcp transports against this machine's ceilings.

    .venv/bin/python benchmarks/bench_transfer.py [--prompt-tokens 1024] [--requests 16] [--repeats 3]

Two processes, one torch thread each, like a prefill and a decode worker, on the workers' own path
(`pdserve/engine/pd.py`): the sender hands each layer's blocks of a prompt to the transport as views into
its KV pool (`block_pieces`); shm (the pool in shared memory, as on a prefill worker) checksums them and
sends their place in the pool, tcp
`sendmsg`s them from the pool; the receiver writes each chunk into the reserved blocks of its own pool
(shm: a copy out of the ring; tcp: `recvmsg_into` the blocks) and verifies the checksum over them. Throughput = KV bytes delivered / (first send .. last block written).
The default model's shape: 30 layers, 3 KV heads, head_dim 64, fp32, block 16 -> 1.5 MB per layer per 1,024
tokens. Ceilings, measured in the same run:
  - memcpy: one thread copying chunk-sized pieces (torch `copy_`) from a 256 MiB region into another one,
    piece after piece, so neither side is cache-resident, like the pools (STREAM-copy style); bytes/s;
  - loopback socket: two processes, a plain TCP socket on 127.0.0.1, `sendall` / `recv_into` of
    chunk-sized pieces walking 256 MiB regions on both sides; bytes/s.
  `memcpy_glibc`: the same walk with glibc's memcpy (`ctypes.memmove`); shm is also given against the faster
  of the two memcpy rows.
  Both also with a hot, chunk-sized buffer reused on each side (`memcpy_hot`, `loopback_hot`): the
  cache-resident upper bound, reported beside them.
Also `shm_receiver_alone`: the shm receiver's path by itself in one process (records already in the ring,
no sender running beside it), to separate its own cost from the two processes competing for memory; and
`copy_verify`: the same walk with the receivers' own `copy_into` (copy 256 KiB, xxh3 what was written,
next) and nothing else — the least any delivery that verifies what it wrote must do.
Before the timed run the sender delivers four untimed prompts (every block range the run uses), so the
timed part is a running server's steady state: connections open, rings and pools mapped.
Writes bench_results/transfer.json. Targets (issue 3): shm >= 80% of memcpy, tcp >= 70% of loopback.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


class _Config:  # the default model's KV shape
    num_kv_heads, head_dim, num_layers = KV_HEADS, HEAD_DIM, LAYERS


def _pool(num_blocks: int, shared: bool = False):
    """A KV pool like the workers' (the prefill worker's in shared memory), filled with random values."""
    import torch

    from pdserve.kv.codec import KVCodec
    from pdserve.kv.device_pool import DeviceKVPool
    torch.set_num_threads(1)
    pool = DeviceKVPool(_Config(), num_blocks, BLOCK, KVCodec("auto", HEAD_DIM, torch.float32), torch.device("cpu"),
                        shared=shared)
    for layer in pool.layers:
        layer.normal_()
    return pool


def _sender(transport: str, dest: str, requests: int, blocks: int, q: mp.Queue, start_q: mp.Queue,
            bye_q: mp.Queue, label: str | None = None) -> None:
    from pdserve.kv.block_io import block_pieces
    from pdserve.transfer import make_sender
    pool = _pool(blocks * 4, shared=transport == "shm")
    sender = make_sender(transport, ring_mb=16, timeout_s=30)  # the workers' default
    if pool.handle:
        sender.share_source(pool.handle, pool.shared_buffer)
    q.get()  # the receiver is listening

    def send(r: int) -> None:
        ids = list(range((r % 4) * blocks, (r % 4 + 1) * blocks))
        for layer, tensor in enumerate(pool.layers):
            header = {"kind": "chunk", "layer": layer, "r": r, **({"label": label} if label else {})}
            sender.send_chunk(dest, header, block_pieces(tensor, ids))

    for r in range(4):  # warm-up, untimed: connections, ring and pool mappings, as in a running server
        send(r)
    sender.send_control(dest, {"kind": "warm"})
    q.get()
    start = time.monotonic()
    for r in range(requests):
        send(r)
    sender.send_control(dest, {"kind": "done"})
    start_q.put(start)
    bye_q.get()  # keep the ring alive until the receiver is done
    sender.close()


def enter_netns(name: str | None) -> None:
    """Move this (single-threaded) process into network namespace `name` (`ip netns`); None: stay."""
    if name is None:
        return
    import ctypes
    with open(f"/var/run/netns/{name}") as f:
        if ctypes.CDLL("libc.so.6", use_errno=True).setns(f.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {name}")


def _receiver(transport: str, addr: str, blocks: int, q: mp.Queue, out: mp.Queue, host: str = "127.0.0.1",
              netns: str | None = None) -> None:
    enter_netns(netns)
    from pdserve.kv.block_io import block_pieces
    from pdserve.transfer import make_receiver
    pool = _pool(blocks * 4).layers
    receiver = make_receiver(transport, addr, host)
    out.put(receiver.address)
    nbytes, bad = 0, 0

    def place(header):
        r = header["r"]
        return block_pieces(pool[header["layer"]], list(range((r % 4) * blocks, (r % 4 + 1) * blocks)))

    q.put("ready")
    while True:
        for msg in receiver.poll(timeout_ms=100, place=place):
            if msg.header["kind"] == "warm":
                nbytes, bad = 0, 0
                q.put("warm")
                continue
            if msg.header["kind"] == "done":
                out.put((time.monotonic(), nbytes, bad))
                receiver.close()
                return
            bad += not msg.verified
            nbytes += msg.header["nbytes"]


def delivery(transport: str, requests: int, blocks: int, host: str = "127.0.0.1", netns: str | None = None,
             label: str | None = None) -> tuple[float, int]:
    """`host`, `netns`: the receiver binds `host` inside network namespace `netns` (tcp, mooncake); `label`: the
    chunks' sensitivity label (`pdserve.core.pd.sensitivity`; none: the default's)."""
    from pdserve.transfer import peer_auth
    os.environ.setdefault(peer_auth.ENV, peer_auth.new_secret())  # one deployment: the tcp hello verifies
    ctx = mp.get_context("spawn")
    to_sender, from_receiver, start_q, bye_q = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    addr = f"ipc://{tempfile.mkdtemp()}/kv"
    recv = ctx.Process(target=_receiver, args=(transport, addr, blocks, to_sender, from_receiver, host, netns))
    recv.start()
    dest = from_receiver.get()
    send = ctx.Process(target=_sender, args=(transport, dest, requests, blocks, to_sender, start_q, bye_q, label))
    send.start()
    end, nbytes, bad = from_receiver.get()
    send_start = start_q.get()
    bye_q.put("bye")
    send.join(30)
    recv.join(30)
    if bad:
        raise SystemExit(f"{transport}: {bad} chunks failed their checksum")
    return nbytes / (end - send_start), nbytes


REGION = 256 << 20


def shm_receiver_alone(requests: int, blocks: int) -> float:
    """The shm receiver's own rate: records of `requests` prompts already in the ring (sent by reference
    from a shared pool in this process), then timed: copy into the receiver's pool + verify, per record."""
    from pdserve.kv.block_io import block_pieces
    from pdserve.transfer import make_receiver, make_sender
    src, dst = _pool(blocks * 4, shared=True), _pool(blocks * 4)
    addr = f"ipc://{tempfile.mkdtemp()}/kv"
    receiver, sender = make_receiver("shm", addr), make_sender("shm", ring_mb=16, timeout_s=30)
    sender.share_source(src.handle, src.shared_buffer)

    def ids(r: int) -> list[int]:
        return list(range((r % 4) * blocks, (r % 4 + 1) * blocks))

    def place(header):
        return block_pieces(dst.layers[header["layer"]], ids(header["r"]))

    def run(n: int) -> float:
        for r in range(n):
            for layer, tensor in enumerate(src.layers):
                sender.send_chunk(addr, {"kind": "chunk", "layer": layer, "r": r}, block_pieces(tensor, ids(r)))
        got, nbytes, start = 0, 0, time.perf_counter()
        while got < n * LAYERS:
            for msg in receiver.poll(100, place):
                got += 1
                nbytes += msg.header["nbytes"] if msg.verified else 0
        return nbytes / (time.perf_counter() - start)

    try:
        run(4)  # warm-up: mappings, as in a running server
        return run(requests)
    finally:
        sender.close()
        receiver.close()


def memcpy_glibc(chunk_bytes: int) -> float:
    """The memcpy ceiling with glibc's own memcpy (`ctypes.memmove`) instead of torch's copy kernel: the same
    walk of chunk-sized pieces between two 256 MiB regions."""
    import ctypes

    import numpy as np
    src, dst = np.frombuffer(os.urandom(1 << 20) * (REGION >> 20), dtype=np.uint8), np.ones(REGION, dtype=np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for off in range(0, REGION - chunk_bytes + 1, chunk_bytes):
            ctypes.memmove(d + off, s + off, chunk_bytes)
        times.append(time.perf_counter() - t0)
    return (REGION // chunk_bytes) * chunk_bytes / statistics.median(times)


def memcpy_ceiling(chunk_bytes: int, hot: bool, verify: bool = False) -> float:
    """Copy chunk-sized pieces between two regions; with `verify`, with the receivers' own `copy_into`
    instead (copies and xxh3s 256 KiB at a time, each right after writing it): the least any
    checksum-verified delivery does."""
    import torch

    from pdserve.transfer.base import copy_into
    torch.set_num_threads(1)
    n = chunk_bytes // 4
    src = torch.randn(n if hot else REGION // 4)
    dst = torch.randn(REGION // 4)
    out, inp = memoryview(dst.numpy()).cast("B"), memoryview(src.numpy()).cast("B")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for off in range(0, dst.numel() - n + 1, n):
            if not verify:
                dst[off:off + n].copy_(src[:n] if hot else src[off:off + n])
                continue
            copy_into([out[4 * off:4 * (off + n)]], [inp[4 * off:4 * (off + n)]])  # the receiver's routine
        times.append(time.perf_counter() - t0)
    return (dst.numel() // n) * n * 4 / statistics.median(times)


def _region(chunk: int, hot: bool) -> tuple[memoryview, int]:
    """A buffer to walk in chunk-sized pieces (touched once, so no page faults are timed) and its size."""
    buf = memoryview(bytearray(os.urandom(1 << 20) * (REGION >> 20) if not hot else bytearray(chunk)))
    return buf, (len(buf) // chunk) * chunk


def _sock_sink(port_q: mp.Queue, chunk: int, total: int, hot: bool, host: str = "127.0.0.1",
               netns: str | None = None) -> None:
    enter_netns(netns)
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf, size = _region(chunk, hot)
    got = 0
    while got < total:
        off = got % size
        n = conn.recv_into(buf[off:off + min(chunk, size - off)])
        if not n:
            break
        got += n
    port_q.put(time.monotonic())
    conn.close()


def loopback_ceiling(chunk: int, total: int, hot: bool, host: str = "127.0.0.1", netns: str | None = None
                     ) -> float:
    """A plain TCP socket's throughput to a sink on `host` (in network namespace `netns`)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sink = ctx.Process(target=_sock_sink, args=(q, chunk, total, hot, host, netns))
    sink.start()
    port = q.get()
    s = socket.create_connection((host, port))
    buf, size = _region(chunk, hot)
    start = time.monotonic()
    sent = 0
    while sent < total:
        off = sent % size
        s.sendall(buf[off:off + chunk])
        sent += chunk
    end = q.get()
    s.close()
    sink.join()
    return total / (end - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    blocks = args.prompt_tokens // BLOCK
    chunk = 2 * KV_HEADS * blocks * BLOCK * HEAD_DIM * 4
    total = chunk * LAYERS * args.requests
    rows = {"memcpy": [], "loopback": [], "memcpy_hot": [], "loopback_hot": [], "shm": [], "tcp": [],
            "shm_receiver_alone": [], "copy_verify": [], "memcpy_glibc": []}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all alike
        rows["memcpy"].append(memcpy_ceiling(chunk, hot=False))
        rows["memcpy_hot"].append(memcpy_ceiling(chunk, hot=True))
        rows["memcpy_glibc"].append(memcpy_glibc(chunk))
        rows["copy_verify"].append(memcpy_ceiling(chunk, hot=False, verify=True))
        rows["loopback"].append(loopback_ceiling(chunk, total, hot=False))
        rows["loopback_hot"].append(loopback_ceiling(chunk, total, hot=True))
        rows["shm"].append(delivery("shm", args.requests, blocks)[0])
        rows["tcp"].append(delivery("tcp", args.requests, blocks)[0])
        rows["shm_receiver_alone"].append(shm_receiver_alone(args.requests, blocks))
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"chunk {chunk / 2**20:.2f} MiB (one layer of {args.prompt_tokens} tokens), "
          f"{total / 2**20:.0f} MiB per run, median of {args.repeats}")
    print(f"{'path':<20}{'GB/s':>8}{'vs ceiling':>12}{'vs hot':>8}")
    for name, ceiling in (("memcpy", None), ("memcpy_glibc", None), ("memcpy_hot", None), ("copy_verify", "memcpy"),
                          ("loopback", None),
                          ("loopback_hot", None), ("shm", "memcpy"), ("tcp", "loopback"),
                          ("shm_receiver_alone", "memcpy")):
        ratio = f"{med[name] / med[ceiling]:.0%}" if ceiling else ""
        hot = f"{med[name] / med[ceiling + '_hot']:.0%}" if ceiling else ""
        if name == "copy_verify":
            hot = ""
        print(f"{name:<20}{med[name] / 1e9:>8.2f}{ratio:>12}{hot:>8}")
    best = max(med["memcpy"], med["memcpy_glibc"])
    print(f"against the faster memcpy ({'torch' if best == med['memcpy'] else 'glibc'}): shm {med['shm'] / best:.0%}, "
          f"copy_verify {med['copy_verify'] / best:.0%}; shm / copy_verify {med['shm'] / med['copy_verify']:.0%}")
    out = Path("bench_results")
    out.mkdir(exist_ok=True)
    (out / "transfer.json").write_text(json.dumps({"args": vars(args), "chunk_bytes": chunk, "runs": rows,
                                                   "median": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
