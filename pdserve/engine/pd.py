"""The two halves of prefill/decode disaggregation around one `LLMEngine` each.

Prefill side: a request arrives with the decode worker's transfer address and the block-table index from
which that worker needs KV (blocks before it are in its prefix cache). It runs as a `prefill_only` request
over every prompt token but the last; after each layer of each step, the new blocks of that layer are pushed
to the decode worker, so delivery overlaps the next layers' compute. When the prompt is done, a `done`
message closes the transfer with the number of chunks sent.

Decode side: `reserve` holds blocks for the whole prompt (or queues the reservation until blocks free up:
no room, no production) and opens an inbound transfer. Verified chunks are written into the reserved blocks.
A completed transfer makes the request runnable: its last prompt token is computed here and gives the first
output token. A failed one (bad checksum, timeout, dead or failing sender, missing blocks) ends in an
explicit, counted outcome: the request is recomputed here from its prompt.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from pdserve.core.request import Request
from pdserve.core.schedule import SchedulerOutput
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.block_io import chunk_nbytes, gather_blocks, scatter_blocks
from pdserve.transfer.base import KVReceiver, KVSender, TransferError, TransferState
from pdserve.transfer.inbound import Inbound, InboundTransfers


@dataclass
class Outbound:
    dest: str
    xfer: str
    next_block: int  # first block-table index not yet delivered in full
    num_chunks: int = 0
    failed: str | None = None


class PrefillSide:
    def __init__(self, engine: LLMEngine, sender: KVSender, kv_layers: list) -> None:
        self.engine = engine
        self.sender = sender
        self.layers = kv_layers
        self.block_size = engine.block_manager.block_size
        self.outbound: dict[str, Outbound] = {}
        self.failures: Counter[str] = Counter()
        self.bytes_sent = 0

    def add(self, request_id: str, prompt: list[int], params, dest: str, xfer: str, first_block: int) -> None:
        req = self.engine.make_request(request_id, prompt[:-1], params, prefill_only=True)
        self.engine.scheduler.add_request(req)
        self.outbound[request_id] = Outbound(dest, xfer, first_block)

    def on_layer(self, scheduled: SchedulerOutput, layer: int) -> None:
        last = layer == len(self.layers) - 1
        for chunk in scheduled.chunks:
            out = self.outbound.get(chunk.request_id)
            if out is None or out.failed:
                continue
            end = chunk.start_pos + chunk.num_tokens
            first, stop = out.next_block, -(-end // self.block_size)
            if first < stop:
                self._push(out, layer, first, list(chunk.block_ids[first:stop]))
            if last:  # a block only partly filled now is sent again, complete, with the next chunk
                out.next_block = max(out.next_block, end // self.block_size)

    def _push(self, out: Outbound, layer: int, first: int, block_ids: list[int]) -> None:
        tensor = self.layers[layer]
        # Bounded chunks: a shm ring holds several at once, and a tcp message never grows with the prompt.
        per_chunk = max(1, getattr(self.sender, "max_chunk_bytes", 1 << 62) // chunk_nbytes(tensor, 1))
        for i in range(0, len(block_ids), per_chunk):
            ids = block_ids[i:i + per_chunk]
            header = {"kind": "chunk", "xfer": out.xfer, "layer": layer, "first": first + i, "count": len(ids)}
            nbytes = chunk_nbytes(tensor, len(ids))
            try:
                self.sender.send_chunk(out.dest, header, nbytes, lambda buf, ids=ids: gather_blocks(tensor, ids, buf))
            except TransferError as e:
                out.failed = str(e)
                self.failures["send_timeout"] += 1
                return
            out.num_chunks += 1
            self.bytes_sent += nbytes

    def finish(self, request_id: str, prefilled: bool) -> str | None:
        """Close the transfer of a request that ended here; the failure message if delivery failed."""
        out = self.outbound.pop(request_id, None)
        if out is None:
            return None
        try:
            if prefilled and not out.failed:
                self.sender.send_control(out.dest, {"kind": "done", "xfer": out.xfer, "num_chunks": out.num_chunks})
                return None
            self.sender.send_control(out.dest, {"kind": "fail", "xfer": out.xfer,
                                                "reason": out.failed or "aborted"})
        except TransferError as e:
            out.failed = out.failed or str(e)
        return out.failed

    def failed_requests(self) -> list[str]:
        return [rid for rid, out in self.outbound.items() if out.failed]


@dataclass
class Reservation:
    request: Request
    xfer: str


@dataclass
class DecodeStats:
    failures: Counter = field(default_factory=Counter)  # by TransferState value; outcome: recompute
    bytes_received: int = 0
    chunks_received: int = 0
    transfers_completed: int = 0


class DecodeSide:
    def __init__(self, engine: LLMEngine, receiver: KVReceiver, kv_layers: list, timeout_s: float) -> None:
        self.engine = engine
        self.receiver = receiver
        self.layers = kv_layers
        self.timeout_s = timeout_s
        self.block_size = engine.block_manager.block_size
        self.inbound = InboundTransfers(len(kv_layers))
        self.pending: deque[Reservation] = deque()  # waiting for blocks, in arrival order
        self.stats = DecodeStats()

    def reserve(self, request_id: str, prompt: list[int], params, xfer: str) -> None:
        """Queue a reservation; `try_reserve` grants it when blocks are free. Raises for a request that
        could never be served (the caller turns that into an error for the client)."""
        req = self.engine.make_request(request_id, prompt, params)
        self.engine.scheduler.check_new(req)  # fail fast, before queueing
        self.pending.append(Reservation(req, xfer))

    def try_reserve(self) -> list[tuple[Reservation, int]]:
        """Grant queued reservations in order while blocks last: [(reservation, first block to deliver)]."""
        granted = []
        while self.pending:
            res = self.pending[0]
            cached = self.engine.scheduler.reserve_kv(res.request)
            if cached is None:
                break
            self.pending.popleft()
            first = cached // self.block_size
            needed = -(-(res.request.num_prompt_tokens - 1) // self.block_size) - first
            self.inbound.expect(res.xfer, res.request.request_id, first, max(needed, 0), self.timeout_s)
            if needed <= 0:
                self.inbound.complete_now(res.xfer)
            granted.append((res, first))
        return granted

    def receive(self, timeout_ms: int = 0) -> None:
        for msg in self.receiver.poll(timeout_ms):
            try:
                self._on_message(msg.header, msg)
            finally:
                msg.release()
        self.inbound.expire()

    def _on_message(self, header: dict, msg) -> None:
        kind = header.get("kind")
        if kind == "chunk":
            # Written into the reserved blocks first, verified right after while the bytes are in cache: a
            # mismatch fails the transfer, and a failed transfer's blocks are dropped, never consumed.
            inbound = self.inbound.accept_chunk(header, True)
            if inbound is not None:
                table = self.engine.block_manager.block_ids(inbound.request_id)
                first, count = header["first"], header["count"]
                scatter_blocks(self.layers[header["layer"]], list(table[first:first + count]), msg.payload)
                if not msg.verified:
                    self.inbound.fail(inbound.xfer, TransferState.FAILED_CHECKSUM)
                    return
                self.stats.chunks_received += 1
                self.stats.bytes_received += header["nbytes"]
        elif kind == "done":
            self.inbound.on_done(header)
        elif kind == "fail":
            self.inbound.fail(header.get("xfer"), TransferState.FAILED_PEER)

    def peer_failed(self, xfer: str) -> None:
        self.inbound.fail(xfer, TransferState.FAILED_PEER)

    def settle(self) -> list[tuple[Inbound, str]]:
        """Act on ended transfers: deliver or recompute. Returns [(transfer, outcome)] for reporting."""
        settled = []
        for inbound in self.inbound.take_ended():
            if inbound.request_id not in self.engine.scheduler.requests:
                continue  # the request ended first (abort): its blocks are already free
            if inbound.state is TransferState.COMPLETED:
                self.engine.scheduler.kv_delivered(inbound.request_id)
                self.stats.transfers_completed += 1
                settled.append((inbound, "delivered"))
            else:
                self.engine.scheduler.kv_failed(inbound.request_id)
                self.stats.failures[inbound.state.value] += 1
                settled.append((inbound, "recompute"))
        return settled

    def abort(self, request_id: str) -> None:
        self.pending = deque(r for r in self.pending if r.request.request_id != request_id)
        self.inbound.abort_request(request_id)
