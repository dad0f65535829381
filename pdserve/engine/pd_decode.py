"""The decode half of prefill/decode disaggregation (`pdserve.engine.pd` has the whole story): reserve
blocks for a prompt, take verified chunks straight into them, settle each transfer (deliver or recompute),
and report the step that first reads delivered KV.

A transfer whose lease lapsed (its prefill worker sent nothing for the timeout: hung, stopped or unreachable)
is, with `hold_lapsed` (a worker under a conductor), not recomputed here: it stays live (its blocks reserved,
late chunks still landing, a `done` still completing it) and the conductor decides: `renew` (the sender's
process is heard: busy, not hung), `redirect` to another prefill worker, or `kv_failed` (recompute here)."""

from __future__ import annotations

import time

from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL
from pdserve.core.pd.decode_books import DecodeBooks, DecodeStats, Grant, Held, Reservation
from pdserve.core.request import Request
from pdserve.core.sched.schedule import SchedulerOutput
from pdserve.engine.checkpoints import KVCheckpoints
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.block_io import block_pieces, chunk_nbytes, land_mixed, mixed_pieces, scatter_blocks
from pdserve.kv.transcode import codec_of, payload_nbytes, transcode
from pdserve.transfer.base import KVReceiver, TransferState
from pdserve.transfer.inbound import Inbound, InboundTransfers


class DecodeSide:
    def __init__(self, engine: LLMEngine, receiver: KVReceiver, kv_layers: list, timeout_s: float,
                 hold_lapsed: bool = False) -> None:
        self.engine = engine
        self.hold_lapsed = hold_lapsed
        self.receiver = receiver
        self.layers = kv_layers
        self.timeout_s = timeout_s
        self.block_size = engine.block_manager.block_size
        self.codec = getattr(engine.executor, "codec", None)  # this pool's; chunks in another are transcoded
        self._sources: dict = {}  # a chunk header's `kv` format -> its KVCodec (False: names none)
        self.inbound = InboundTransfers(len(kv_layers))
        # reservations, grants, waiting reports, settlement, consumption: the decisions the simulator runs too
        self.books = DecodeBooks(engine.scheduler, self.block_size)
        self.stats: DecodeStats = self.books.stats
        self.checkpoints: KVCheckpoints | None = None  # with a disk tier (`pdserve.engine.checkpoints`)

    @property
    def pending(self) -> list[Reservation]:
        return self.books.pending

    @property
    def held(self) -> dict[str, Held]:
        return self.books.held

    def reserve(self, request_id: str, prompt: list[int], params, xfer: str, priority: int = 0,
                pin: tuple[str, float] | None = None, service_tier: str = "default",
                restore: dict | None = None, sensitivity: str = DEFAULT_LABEL) -> None:
        """Queue a reservation; `try_reserve` grants it when blocks are free. Raises for a request that
        could never be served (the caller turns that into an error for the client). `restore`: {peer, tokens},
        a request moved off the dead worker `peer` whose first `tokens` tokens' KV it left on disk: adopted
        here, and the rest computed here (no prefill worker) when they all hit."""
        req = self.engine.make_request(request_id, prompt, params, priority, pin=pin, service_tier=service_tier,
                                       sensitivity=sensitivity)
        self.engine.scheduler.check_new(req)  # fail fast, before a checkpoint is adopted
        local, adopted = 1, 0
        if restore and self.checkpoints is not None:
            adopted = self.checkpoints.adopt(restore["peer"], prompt[:restore["tokens"]])
            local = max(len(prompt) - restore["tokens"], 1)
        self.books.reserve(req, xfer, local, adopted)

    def try_reserve(self) -> list[Grant]:
        """Grant queued reservations in policy order while blocks last (`DecodeBooks.grant`), each expecting
        its transfer (one that needs no prefill worker is complete at once)."""
        granted = self.books.grant()
        for g in granted:
            res = g.reservation
            self.inbound.expect(res.xfer, res.request.request_id, g.first_block, g.num_blocks, self.timeout_s)
            if not g.needs_prefill:
                self.inbound.complete_now(res.xfer)
        return granted

    def newly_waiting(self) -> list[tuple[str, str]]:
        """(request id, xfer) of reservations left waiting for room, each reported once: the conductor may
        have the prompt staged meanwhile."""
        return [(r.request.request_id, r.xfer) for r in self.books.newly_waiting()]

    def receive(self, timeout_ms: int = 0) -> None:
        """Take what arrived, then lapse the leases that ran out before this poll began: a poll reads every
        record sent before it began, so a record sent while this worker was busy (placing a long run of
        chunks, or anything else) is read before its sender is judged silent."""
        began = time.monotonic()
        for msg in self.receiver.poll(timeout_ms, self._place):
            self._on_message(msg)
        self.inbound.expire(began, hold=self.hold_lapsed)

    def wait_ms(self, idle_ms: int) -> int:
        """How long the worker may sleep in its poller: 0 if KV is already waiting; with transfers in
        flight, `idle_ms` when the transport rings `receiver.wakeup`, else 1 ms (the transport is polled)."""
        if not len(self.inbound):
            return idle_ms
        if self.receiver.wakeup is None:
            return 1
        return idle_ms if self.receiver.arm() else 0

    def _place(self, header: dict) -> list[memoryview] | None:
        """Where a chunk's payload may go: the blocks its live transfer expects there, else nowhere."""
        inbound = self.inbound.target(header) if header.get("kind") == "chunk" else None
        if inbound is None:
            return None
        layer = self.layers[header["layer"]]
        source = self._source_codec(header)
        if source is not None:  # another format: staged, transcoded once verified
            if source is False or payload_nbytes(source, layer.shape[1], self.block_size, header["count"]) \
                    != header.get("nbytes"):
                return None  # booked as a bad chunk below
            return [memoryview(bytearray(header["nbytes"]))]
        if chunk_nbytes(layer, header["count"]) != header.get("nbytes"):
            return None  # not this pool's block format: booked as a bad chunk below
        if self._head_recoded(header, inbound):
            return [memoryview(bytearray(header["nbytes"]))]  # staged: transcoded into the host tier's codec
        return self._targets(header, inbound) or [memoryview(bytearray(header["nbytes"]))]  # staged: scattered

    def _source_codec(self, header: dict):
        """None when a chunk is in this pool's format; else its codec, or False when it names none."""
        fmt = header.get("kv")
        if self.codec is None or fmt is None or fmt == self.codec.format:
            return None
        if not isinstance(fmt, str):
            return False
        if fmt not in self._sources:  # once per format, not per chunk (int4's builds its rotation)
            self._sources[fmt] = codec_of(fmt, self.codec) or False
        return self._sources[fmt]

    def _targets(self, header: dict, inbound: Inbound) -> list[memoryview] | None:
        """The pool's (or host tier's) bytes a chunk's payload goes to, in wire order; None on another device
        (staged, then scattered)."""
        table = self.engine.block_manager.block_ids(inbound.request_id)
        first, count = header["first"], header["count"]
        layer = self.layers[header["layer"]]
        cold = self.engine.scheduler.requests[inbound.request_id].cold_hashes
        head = self._head_targets(header, inbound)
        if head:  # a long prompt's head goes into host tier entries (CPU pools only)
            return mixed_pieces(layer, self.engine.kv_io.host.data, header["layer"], head)
        ids = list(table[first - len(cold):first - len(cold) + count])
        if layer.device.type == "cpu":
            return block_pieces(layer, ids)
        return None

    def _head_targets(self, header: dict, inbound: Inbound) -> list:
        """A chunk of a long prompt's head: one ("host", slot) or ("device", block id) per block; else []."""
        first, count = header["first"], header["count"]
        cold = self.engine.scheduler.requests[inbound.request_id].cold_hashes
        if first >= len(cold):
            return []
        table, tiers = self.engine.block_manager.block_ids(inbound.request_id), self.engine.tiers
        return [("host", tiers.host_slot(cold[i])) if i < len(cold) else ("device", table[i - len(cold)])
                for i in range(first, first + count)]

    def _head_recoded(self, header: dict, inbound: Inbound) -> bool:
        """A head chunk for a host tier of another codec than the pool's: staged, then transcoded in `_land`."""
        kv_io = self.engine.kv_io
        return kv_io is not None and kv_io.host.recode is not None and bool(self._head_targets(header, inbound))

    def _on_message(self, msg) -> None:
        header = msg.header
        kind = header.get("kind")
        if kind == "chunk":
            if not msg.written:  # nowhere to put it: a late chunk, or one its transfer does not expect
                self.inbound.reject(header)
                return
            # A failed transfer's blocks (a checksum mismatch included) are dropped, never consumed.
            inbound = self.inbound.accept_chunk(header, msg.verified)
            if inbound is None:
                return
            source = self._source_codec(header)
            if source is not None:
                self._land(header, inbound, transcode(msg.views[0], source, self.codec))
                self.stats.chunks_transcoded += 1
            elif self.layers[header["layer"]].device.type != "cpu" or self._head_recoded(header, inbound):
                self._land(header, inbound, msg.views[0])
            self.stats.chunks_received += 1
            self.stats.bytes_received += header["nbytes"]
        elif kind == "done":
            self.inbound.on_done(header, self.engine.executor.vocab_size)
        elif kind == "alive":
            self.inbound.renew(header.get("xfer"))
        elif kind == "fail":
            self.inbound.fail(header.get("xfer"), TransferState.FAILED_PEER)

    def _land(self, header: dict, inbound: Inbound, payload) -> None:
        """A staged payload (this pool's format) into the blocks its chunk fills."""
        if self._head_recoded(header, inbound):
            land_mixed(self.layers[header["layer"]], self.engine.kv_io.host, header["layer"],
                       self._head_targets(header, inbound), payload)
            return
        targets = self._targets(header, inbound)
        if targets is None:  # a pool on another device
            table = self.engine.block_manager.block_ids(inbound.request_id)
            first, count = header["first"], header["count"]
            cold = len(self.engine.scheduler.requests[inbound.request_id].cold_hashes)
            scatter_blocks(self.layers[header["layer"]], list(table[first - cold:first - cold + count]), payload)
            return
        at = 0
        for piece in targets:
            piece[:] = payload[at:at + len(piece)]
            at += len(piece)

    def redirect(self, old: str, new: str) -> Inbound | None:
        """Its prefill worker died or hung and the conductor moved the prompt to another: expect the KV anew
        under `new` into the same reserved blocks (what arrived under `old` is overwritten: wasted). Returns
        the new transfer, or None when `old` had ended meanwhile (delivered, or failed and recomputed here):
        only once this worker expects it may the new prefill worker send, or its first records would be
        dropped as unknown and the transfer lapse."""
        held = self.books.unhold(old)
        inbound = self.inbound.restart(old, new)
        if inbound is None:
            return None
        self.books.redirected(held is not None, inbound.num_bytes)
        return self.inbound.get(new)

    def renew(self, xfer: str) -> bool:
        """The conductor heard the lapsed transfer's sender (its process is alive, only busy): its lease
        starts over, with what arrived meanwhile kept. False when it had ended (completed meanwhile)."""
        return self.books.unhold(xfer) is not None and self.inbound.resume(xfer)

    def peer_failed(self, xfer: str, reason: str = "failed_timeout") -> None:
        """The conductor says this KV will not come (`reason`: why): recompute the prompt here."""
        held = self.books.unhold(xfer)
        if held is None:
            inbound = self.inbound.get(xfer)
            if inbound is not None and not inbound.state.ended:
                self.books.give_up(inbound.request_id, reason)
                self.inbound.fail(xfer, TransferState.FAILED_PEER)
            return
        dropped = self.inbound.drop(xfer)
        if dropped is None:
            return  # it completed meanwhile: already delivered
        self.books.lapse_failed(held, dropped.num_bytes, reason)

    def settle(self) -> list[tuple[Inbound, str, Request | None]]:
        """Act on ended transfers: deliver or recompute. Returns [(transfer, outcome, request)] for reporting;
        a delivered request that came with its first token has it as its first output (and may already be
        finished by it): the caller reports that token, no step computes it here."""
        settled = []
        for inbound in self.inbound.take_lapsed():  # held live: the conductor decides
            if self.inbound.get(inbound.xfer) is inbound:
                inbound.lapses += 1
                self.books.hold(Held(inbound.xfer, inbound.request_id, inbound.lapses),
                                TransferState.FAILED_TIMEOUT.value)
                settled.append((inbound, "held", None))
        for inbound in self.inbound.take_ended():
            self.books.unhold(inbound.xfer)  # (one that lapsed and then ended: its end is what counts)
            outcome, req = self.books.settle(inbound.request_id, inbound.state is TransferState.COMPLETED,
                                             inbound.first_token, inbound.num_bytes, inbound.state.value)
            if outcome != "aborted":  # (the request ended first: its blocks are already free)
                settled.append((inbound, outcome, req))
        return settled

    def consumed(self, scheduled: SchedulerOutput | None) -> list[str]:
        """The requests whose delivered KV the step `scheduled` read first."""
        if scheduled is None:
            return []
        return self.books.consumed(c.request_id for c in scheduled.chunks)

    def abort(self, request_id: str) -> None:
        self.books.abort(request_id)
        self.inbound.abort_request(request_id)
