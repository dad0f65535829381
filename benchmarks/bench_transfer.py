"""KV delivery throughput of the shm and tcp transports against this machine's ceilings.

    .venv/bin/python benchmarks/bench_transfer.py [--prompt-tokens 1024] [--requests 16] [--repeats 3]

Two processes, one torch thread each, like a prefill and a decode worker: the sender gathers each layer's
blocks of a prompt from its KV pool straight into the transport (shm ring / tcp message), checksums them and
sends; the receiver verifies the checksum and scatters the blocks into its own pool, exactly as the workers
do (`pdserve/engine/pd.py`). Throughput = KV bytes delivered / (first send .. last block written).
The default model's shape: 30 layers, 3 KV heads, head_dim 64, fp32, block 16 -> 1.5 MB per layer per 1,024
tokens. Ceilings, measured in the same run:
  - memcpy: one thread copying a buffer of the chunk's size into another (torch `copy_`, a fresh
    destination region each time so it is not cache-resident), bytes copied per second;
  - loopback socket: two processes, a plain TCP socket on 127.0.0.1, `sendall` / `recv_into` of the same
    chunk size, bytes per second.
Writes bench_results/transfer.json. Targets (issue 3): shm >= 80% of memcpy, tcp >= 70% of loopback.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def _pool(num_blocks: int):
    import torch
    torch.set_num_threads(1)
    return [torch.randn(2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM) for _ in range(LAYERS)]


def _sender(transport: str, dest: str, requests: int, blocks: int, q: mp.Queue, start_q: mp.Queue,
            bye_q: mp.Queue) -> None:
    from pdserve.kv.block_io import chunk_nbytes, gather_blocks
    from pdserve.transfer import make_sender
    pool = _pool(blocks * 4)
    sender = make_sender(transport, ring_mb=16, timeout_s=30)  # the workers' default
    q.get()  # the receiver is listening
    start = time.monotonic()
    for r in range(requests):
        ids = list(range((r % 4) * blocks, (r % 4 + 1) * blocks))
        for layer, tensor in enumerate(pool):
            sender.send_chunk(dest, {"kind": "chunk", "layer": layer}, chunk_nbytes(tensor, len(ids)),
                              lambda buf, t=tensor, ids=ids: gather_blocks(t, ids, buf))
    sender.send_control(dest, {"kind": "done"})
    start_q.put(start)
    bye_q.get()  # keep the ring alive until the receiver is done
    sender.close()


def _receiver(transport: str, addr: str, blocks: int, q: mp.Queue, out: mp.Queue) -> None:
    from pdserve.kv.block_io import scatter_blocks
    from pdserve.transfer import make_receiver
    pool = _pool(blocks * 4)
    receiver = make_receiver(transport, addr)
    out.put(receiver.address)
    nbytes, bad, r = 0, 0, 0
    q.put("ready")
    while True:
        for msg in receiver.poll(timeout_ms=100):
            if msg.header["kind"] == "done":
                out.put((time.monotonic(), nbytes, bad))
                receiver.close()
                return
            if not msg.verified:
                bad += 1
            ids = list(range((r % 4) * blocks, (r % 4 + 1) * blocks))
            scatter_blocks(pool[msg.header["layer"]], ids, msg.payload)
            nbytes += msg.header["nbytes"]
            msg.release()
            r += msg.header["layer"] == LAYERS - 1


def delivery(transport: str, requests: int, blocks: int) -> tuple[float, int]:
    ctx = mp.get_context("spawn")
    to_sender, from_receiver, start_q, bye_q = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    addr = f"ipc://{tempfile.mkdtemp()}/kv"
    recv = ctx.Process(target=_receiver, args=(transport, addr, blocks, to_sender, from_receiver))
    recv.start()
    dest = from_receiver.get()
    send = ctx.Process(target=_sender, args=(transport, dest, requests, blocks, to_sender, start_q, bye_q))
    send.start()
    end, nbytes, bad = from_receiver.get()
    send_start = start_q.get()
    bye_q.put("bye")
    send.join(30)
    recv.join(30)
    if bad:
        raise SystemExit(f"{transport}: {bad} chunks failed their checksum")
    return nbytes / (end - send_start), nbytes


def memcpy_ceiling(chunk_bytes: int, total_bytes: int) -> float:
    import torch
    torch.set_num_threads(1)
    n = chunk_bytes // 4
    src = torch.randn(n)
    dst = torch.empty(max(total_bytes // 4, n))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for off in range(0, dst.numel() - n + 1, n):
            dst[off:off + n].copy_(src)
        times.append(time.perf_counter() - t0)
    return (dst.numel() // n) * n * 4 / statistics.median(times)


def _sock_sink(port_q: mp.Queue, chunk: int, total: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(chunk)
    view = memoryview(buf)
    got = 0
    while got < total:
        n = conn.recv_into(view)
        if not n:
            break
        got += n
    port_q.put(time.monotonic())
    conn.close()


def loopback_ceiling(chunk: int, total: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sink = ctx.Process(target=_sock_sink, args=(q, chunk, total))
    sink.start()
    port = q.get()
    s = socket.create_connection(("127.0.0.1", port))
    payload = bytes(chunk)
    start = time.monotonic()
    sent = 0
    while sent < total:
        s.sendall(payload)
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
    rows = {"memcpy": [], "loopback": [], "shm": [], "tcp": []}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all alike
        rows["memcpy"].append(memcpy_ceiling(chunk, 256 << 20))
        rows["loopback"].append(loopback_ceiling(chunk, total))
        rows["shm"].append(delivery("shm", args.requests, blocks)[0])
        rows["tcp"].append(delivery("tcp", args.requests, blocks)[0])
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"chunk {chunk / 2**20:.2f} MiB (one layer of {args.prompt_tokens} tokens), "
          f"{total / 2**20:.0f} MiB per run, median of {args.repeats}")
    print(f"{'path':<10}{'GB/s':>8}{'vs ceiling':>12}")
    for name, ceiling in (("memcpy", None), ("loopback", None), ("shm", "memcpy"), ("tcp", "loopback")):
        ratio = f"{med[name] / med[ceiling]:.0%}" if ceiling else ""
        print(f"{name:<10}{med[name] / 1e9:>8.2f}{ratio:>12}")
    out = Path("bench_results")
    out.mkdir(exist_ok=True)
    (out / "transfer.json").write_text(json.dumps({"args": vars(args), "chunk_bytes": chunk, "runs": rows,
                                                   "median": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
