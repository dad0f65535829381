"""The two halves of prefill/decode disaggregation around one `LLMEngine` each (the decode half's code is in
`pdserve.engine.pd_decode`, re-exported here).

Prefill side: a request arrives with the decode worker's transfer address and the block-table index from
which that worker needs KV (blocks before it are in its prefix cache). It runs as a `prefill_only` request
over the whole prompt; after each layer of each step, the new blocks of that layer are queued for the decode
worker's link and sent from there by the link's own thread (`pdserve.transfer.outbox`), straight from the
pool, so delivery overlaps the next layers' compute and never holds it up. The last step samples the
first output token, and a `done` record closes the transfer with it and the number of chunks sent.

Staging: while the decode worker has no room for a prompt's blocks, the conductor may have this worker compute
it ahead (`stage`, `pdserve.core.sched.stage_passes`): its KV stays in the prefix cache and the host tier
(write-through, pinned there), holding no device blocks, and the real prefill dispatched later finds it there
and only sends it. Staged KV lost before delivery (evicted, or its request aborted) is counted as wasted
bytes.

Decode side: `reserve` holds blocks for the whole prompt (or queues the reservation until blocks free up:
no room, no production) and opens an inbound transfer. The transport writes each chunk straight into the
reserved blocks the transfer expects (nowhere else) and verifies it there; only verified chunks count.
A completed transfer brings the first token: the request decodes on from it (or ends by it) with no step
recomputing anything here. A failed one (bad checksum, timeout, dead or failing sender, missing blocks,
no valid first token) ends in an explicit, counted outcome: the request is recomputed here from its prompt.
When every prompt token but the last is in this worker's prefix cache, no prefill worker is involved: the
last prompt token is computed here and gives the first token.
"""

from __future__ import annotations

import time
from collections import Counter

from pdserve.core.pd.breaker import BreakerPolicy
from pdserve.core.pd.delivery import DeliveryPolicy, WaterLevel
from pdserve.core.pd.prefill_books import Lent, Outbound, PrefillBooks
from pdserve.core.pd.production_pace import ProductionPace
from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL
from pdserve.core.pd.wire_format import COMPACT, LinkView, WireFormat, tiers_ahead
from pdserve.core.sched.stage_passes import WARM_PARAMS, WARM_PRIORITY, WARM_TIER, StagePasses
from pdserve.core.sched.schedule import SchedulerOutput
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.block_io import block_pieces, chunk_nbytes, gather_blocks
from pdserve.kv.transcode import codec_of, transcode
from pdserve.transfer.base import KVSender, TransferError
from pdserve.transfer.outbox import Chunk, Outbox


GRACE = "kv-grace:"  # the pin holder of a prompt kept for a re-route (`PrefillSide.keep`)


class PrefillSide:
    def __init__(self, engine: LLMEngine, sender: KVSender, kv_layers: list, lease_s: float = 30.0,
                 policy: DeliveryPolicy | None = None, link_rate: float | None = None,
                 water: WaterLevel | None = None, wire: WireFormat | None = None) -> None:
        self.engine = engine
        self.sender = sender
        self.layers = kv_layers
        self.block_size = engine.block_manager.block_size
        policy = policy or DeliveryPolicy()
        # transfers, closings, loans, keepalives, landings: the decisions the simulator runs too
        self.books = PrefillBooks(self.block_size, lease_s)
        self.lease_s = lease_s
        self.failures: Counter[str] = Counter()
        self.reported_ok: set[str] = set()  # ended prefilled with no failure so far, their closing record not sent
        # (request id, why): transfers whose sends failed after their request was reported prefilled; the worker
        # reports them again (`prefilled` with the failure), so their decode worker stops waiting at once
        self.late_failures: list[tuple[str, str]] = []
        self.peers: dict[str, str] = {}  # receiver address -> its worker's name (the breakers' report)
        self.grace_pins = 0  # prompts whose KV was kept pinned for a re-route (their transfer lost to its path)
        self.outbox = Outbox(sender, policy, self._hold, link_rate, failures=self.failures,
                             on_closed=self._closed)
        self.water = water or WaterLevel()
        self.paused_s = 0.0  # production held back by its links' backlog (the worker loop adds it up)
        self.pace_counts: Counter[str] = Counter()  # chunks capped, prompts held by their link's backlog
        self.stages = StagePasses(engine.scheduler, engine.tiers)
        self.wasted_bytes: Counter[str] = Counter()  # staged, never delivered: stage_aborted, stage_evicted
        self.block_bytes = sum(chunk_nbytes(t, 1) for t in kv_layers)
        codec = getattr(engine.executor, "codec", None)  # named in each chunk: a receiver of another transcodes
        self.codec = codec
        self.kv_format = None if codec is None else codec.format
        self.wire = wire or WireFormat()
        self._wire_codecs: dict = {}  # format -> its KVCodec (built once)
        self.wire_bytes: Counter[tuple[str, str]] = Counter()  # (service tier, format) -> bytes queued
        pool = getattr(engine.executor, "kv_pool", None)
        if getattr(pool, "handle", None) and sender.capabilities.zero_copy:
            sender.share_source(pool.handle, pool.shared_buffer)  # chunks go by reference

    def add(self, request_id: str, prompt: list[int], params, dest: str, xfer: str, first_block: int,
            priority: int = 0, pin: tuple[str, float] | None = None, service_tier: str = "default",
            link: str | None = None, deadline_in_s: float | None = None, read_in_s: float | None = None,
            sensitivity: str = DEFAULT_LABEL) -> None:
        """`deadline_in_s`: the conductor's predicted first consumption of this KV, from now (the delivery
        deadline under `--delivery scheduled`); `read_in_s`: the same were the link free (the wire format's
        slack)."""
        req = self.engine.make_request(request_id, prompt, params, priority, prefill_only=True, pin=pin,
                                       service_tier=service_tier, sensitivity=sensitivity)
        self.engine.scheduler.check_new(req)  # fail now, even when it waits for its stage pass
        self.stages.add_real(request_id, req.arrival_s, lambda: self.engine.scheduler.add_request(req))
        window = self.engine.scheduler.window
        # Chunks read in place hold their blocks until the request ends: a prompt that must slide through
        # the pool sends copies instead.
        long = window is not None and self.engine.block_manager.blocks_needed(len(prompt)) > window.window
        now = time.monotonic()
        self.peers[dest] = link or dest
        out = self.books.open(Outbound(
            request_id, dest, xfer, first_block, len(prompt), link or dest, service_tier,
            float("inf") if deadline_in_s is None else now + deadline_in_s, by_copy=long, sensitivity=sensitivity))
        out.wire_format = self._wire_format(out, read_in_s)
        self._alive(out, now)  # queued here: the receiver's lease runs from now, renewed

    def _wire_format(self, out: Outbound, read_in_s: float | None) -> str | None:
        """The format `out` travels in (`pdserve.core.pd.wire_format`), from its link's state now and when the
        decode worker would read it were the link free."""
        if self.kv_format is None:
            return None
        ahead = tiers_ahead(out.tier)
        backlog = self.outbox.link_backlog(out.link, ahead)
        queued, rate = backlog[0] if backlog else (0.0, self.outbox.link_rate_of(out.link))
        queued += self.books.unproduced_bytes(out.link, ahead, self.block_bytes, but=out)  # taken, not yet computed
        blocks = -(-out.num_tokens // self.block_size) - out.next_block
        compact = self._wire_codec(COMPACT)
        ratio = compact.token_bytes / self.codec.token_bytes if compact is not None else 1.0
        return self.wire.choose(out.tier, self.kv_format, blocks * self.block_bytes, LinkView(queued, rate),
                                read_in_s, ratio)

    def _wire_codec(self, fmt: str):
        if fmt not in self._wire_codecs:
            self._wire_codecs[fmt] = codec_of(fmt, self.codec)
        return self._wire_codecs[fmt]

    def stage(self, request_id: str, prompt: list[int], params, priority: int = 0,
              service_tier: str = "default", sensitivity: str = DEFAULT_LABEL) -> None:
        """Compute a prompt ahead, with no transfer (`pdserve.core.sched.stage_passes`)."""
        self.stages.stage(self.engine.make_request(request_id, prompt, params, priority, prefill_only=True,
                                                   service_tier=service_tier, sensitivity=sensitivity))

    def warm(self, request_id: str, prompt: list[int], sensitivity: str = DEFAULT_LABEL) -> None:
        """Compute a hot prefix ahead, for no request in particular (`pdserve.conductor.hot_prefixes`); its KV
        labelled `sensitivity`."""
        self.stages.warm(self.engine.make_request(request_id, prompt, WARM_PARAMS, WARM_PRIORITY,
                                                  prefill_only=True, service_tier=WARM_TIER,
                                                  sensitivity=sensitivity))

    def stage_ended(self, request_id: str, ok: bool) -> str | None:
        """A request of this worker ended: for a stage pass, its request's id; else None."""
        return self.stages.ended(request_id, ok)

    def drop_stage(self, request_id: str, cached_tokens: int | None = None) -> None:
        """`request_id` ended here: prefilled with `cached_tokens` from the cache (staged blocks missing then
        were evicted before delivery), or aborted (`None`: a stage pass's blocks are wasted)."""
        lost = self.stages.drop(request_id, cached_tokens)
        if lost:
            self.wasted_bytes["stage_aborted" if cached_tokens is None else "stage_evicted"] += lost * self.block_bytes

    def keepalive(self, now: float | None = None) -> None:
        """Renew the receiver's lease of every transfer this worker holds (queued, producing, or waiting for
        its link) that sent nothing for a third of the lease: waiting here is not a failed delivery, a dead or
        hung sender is (its leases lapse)."""
        now = time.monotonic() if now is None else now
        for out in self.books.keepalive_due(now):
            self._alive(out, now)

    def _alive(self, out: Outbound, now: float) -> None:
        """Renew the receiver's lease of `out`: sent by its link's lane ahead of its queued chunks."""
        self.outbox.control(out, {"kind": "alive", "xfer": out.xfer})
        self.books.sent(out, now, alive=True)

    def on_layer(self, scheduled: SchedulerOutput, layer: int) -> None:
        last = layer == len(self.layers) - 1
        for chunk in scheduled.chunks:
            # a long prompt's oldest blocks left the pool (`cold_slots`): they were sent when computed
            cold = len(chunk.cold_slots)
            pushed = self.books.push(chunk.request_id, chunk.start_pos + chunk.num_tokens, cold, advance=last)
            if pushed is None:
                continue
            out, span = pushed
            if span.first < span.full:
                self._push(out, layer, span.first, list(chunk.block_ids[span.first - cold:span.full - cold]))
            if span.partial:  # the prompt's last block, partly filled: sent as a copy
                self._push(out, layer, span.full, [chunk.block_ids[span.full - cold]], partial=True)
        self.outbox.pump()
        self.keepalive()  # also during a step longer than a third of the lease

    def _push(self, out: Outbound, layer: int, first: int, block_ids: list[int], partial: bool = False) -> None:
        tensor = self.layers[layer]
        # Bounded chunks: a shm ring holds several at once, and a tcp message never grows with the prompt;
        # smaller while the link is congested (`Outbox.chunk_blocks`).
        one = chunk_nbytes(tensor, 1)
        most = max(1, self.sender.max_chunk_bytes // one)
        per_chunk = self.outbox.chunk_blocks(out.link, one, most)
        for i in range(0, len(block_ids), per_chunk):
            ids = block_ids[i:i + per_chunk]
            header = {"kind": "chunk", "xfer": out.xfer, "layer": layer, "first": first + i, "count": len(ids),
                      "label": out.sensitivity}
            if self.kv_format is not None:
                header["kv"] = out.wire_format or self.kv_format
            pieces, copied = _pieces(tensor, ids), False
            if out.wire_format not in (None, self.kv_format):  # re-encoded: a copy in the transfer's format
                pieces, copied = [transcode(b"".join(pieces), self.codec, self._wire_codec(out.wire_format))], True
            elif partial or out.by_copy:  # the block changes, or leaves the pool: its bytes as they are now
                pieces = [memoryview(bytes(p)) for p in pieces]
            nbytes = sum(len(p) for p in pieces) if copied else chunk_nbytes(tensor, len(ids))
            self.wire_bytes[(out.tier, header.get("kv", "auto"))] += nbytes
            self.outbox.push(Chunk(out, header, pieces, nbytes, ids, partial, copy=copied))

    def _hold(self, out: Outbound, ids: list[int]) -> None:
        new = [b for b in ids if b not in out.held]
        self.engine.block_manager.hold(out.holder, new)
        out.held.update(new)

    def pace(self) -> ProductionPace:
        """This step's production pace, per link (`pdserve.core.pd.production_pace`); its `hold_s` > 0: the
        worker produces nothing now (all its prompts are bound for links that are backed up)."""
        def link_of(rid: str) -> str | None:
            out = self.books.outbound.get(rid)
            return None if out is None else out.link
        return ProductionPace.build(self.engine.scheduler.requests.values(), link_of, self.outbox.link_backlog,
                                    self.water, self.block_bytes / self.block_size, self.block_size,
                                    self.pace_counts)

    def pump(self) -> None:
        """Take what the links' lanes did since (closed transfers); the worker loop calls this between steps."""
        self.outbox.pump()

    def keep(self, request_id: str) -> int:
        """`request_id`'s delivery failed and it is about to be aborted here: the KV it computed so far stays
        pinned in the prefix cache for the breaker policy's `grace_s`, so its request re-routed through this
        worker finds it (`pdserve.core.kvstore.block_holds.PrewarmPins`). Returns the blocks pinned."""
        if request_id not in self.engine.scheduler.requests:
            return 0
        breakers = getattr(self.sender, "breakers", None)
        blocks = self.engine.block_manager
        grace_s = (breakers.policy if breakers else BreakerPolicy()).grace_s
        pinned = blocks.pin(GRACE + request_id, request_id, blocks.clock() + grace_s)
        self.grace_pins += pinned > 0
        return pinned

    def landing_in_s(self, request_id: str) -> float | None:
        """When the last of this request's KV will have left for its decode worker, from now."""
        out = self.books.outbound.get(request_id)
        if out is None:
            return None
        landing = self.outbox.landing_in_s(out)
        self.books.landings.report(request_id, time.monotonic() + landing)
        return landing

    def relanded(self) -> list[tuple[str, float]]:
        """Prefilled transfers still queued whose landing estimate moved by more than `RELAND_S` since it was
        last reported (another transfer became due on their link): [(request id, landing from now)]."""
        def landing_in_s(rid: str) -> float | None:
            out = self.books.closing.get(rid)
            return None if out is None else self.outbox.landing_in_s(out, expedite=False)
        return self.books.landings.moved(time.monotonic(), landing_in_s)

    def finish(self, request_id: str, prefilled: bool, first_token: int | None = None,
               logprobs: dict | None = None) -> str | None:
        """Close the transfer of a request that ended here (`first_token`: what it sampled, `logprobs`: the
        logprobs asked for); the failure message if delivery failed. A prefilled transfer's closing record goes
        after its last queued chunk; any other's at once (its queued chunks dropped)."""
        known = self.books.outbound.get(request_id) or self.books.closing.get(request_id)
        queued = known is not None and self.outbox.queued(known.xfer)
        out, now = self.books.finish(request_id, prefilled, queued, first_token, logprobs)
        if out is None:
            return None
        if now:
            self.outbox.drop(out)
        self.outbox.close(out, prefilled, first_token)
        if prefilled and not out.failed:
            self.reported_ok.add(request_id)
        return out.failed

    def _closed(self, out: Outbound, mark: int) -> None:
        """`out`'s closing record went (`mark`: the sender's position after it): what the receiver reads in
        place stays lent until it took it. One whose sends failed after its request was reported prefilled
        is a late failure (`late_failures`)."""
        self.books.drained(out)
        if out.rid in self.reported_ok:
            self.reported_ok.discard(out.rid)
            if out.failed:
                self.late_failures.append((out.rid, out.failed))
        self.books.lend(out, mark, time.monotonic())

    def peer_gone(self, dest: str) -> int:
        """The decode worker at `dest` died (or restarted): its transfers end here without a word to it (the
        conductor moves their requests), the blocks held or lent for it are freed and the sender forgets it
        (a restarted worker at the same address gets a fresh ring or connection). Returns how many ended."""
        gone, lent = self.books.peer_gone(dest)
        for out in gone:
            self.reported_ok.discard(out.rid)
            self.outbox.drop(out)
            if out.held:
                self.engine.block_manager.free(out.holder)
                out.held.clear()  # (a closing record already on its way lends nothing then)
        for loan in lent:
            self.engine.block_manager.free(loan.holder)
        self.outbox.forget(dest)
        return len(gone)

    def release_lent(self, now: float | None = None) -> int:
        """Free the blocks of transfers the receiver has taken (or whose lease ran out). Returns how many
        transfers were released."""
        def consumed(lent: Lent) -> bool:
            try:
                return self.sender.consumed(lent.dest, lent.mark)
            except TransferError:
                return False
        released = self.books.release(time.monotonic() if now is None else now, consumed)
        for lent in released:
            self.engine.block_manager.free(lent.holder)
        return len(released)

    # the books' records, as the worker loop, its stats and the tests read them
    outbound = property(lambda self: self.books.outbound)
    closing = property(lambda self: self.books.closing)
    lent = property(lambda self: self.books.lent)
    landings = property(lambda self: self.books.landings)
    keepalives_sent = property(lambda self: self.books.keepalives_sent)

    def failed_requests(self) -> list[str]:
        return self.books.failed_requests()


def _pieces(layer, block_ids: list[int]) -> list[memoryview]:
    """The chunk payload as views into a CPU pool, or gathered into a host buffer from another device."""
    if layer.device.type == "cpu":
        return block_pieces(layer, block_ids)
    buf = bytearray(chunk_nbytes(layer, len(block_ids)))
    gather_blocks(layer, block_ids, buf)
    return [memoryview(buf)]


from pdserve.engine.pd_decode import DecodeSide, DecodeStats, Reservation  # noqa: E402  (the decode half)

__all__ = ["DecodeSide", "DecodeStats", "Lent", "Outbound", "PrefillSide", "Reservation"]
