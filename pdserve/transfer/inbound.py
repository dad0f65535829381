"""The receiving side's book of transfers: what must arrive, what did, and how each one ends.

Pure bookkeeping (no torch, no sockets): the decode worker asks `accept_chunk` before writing a payload into
its pool, and acts on the transfers `take_ended` returns. A chunk is written only into the blocks of the
transfer it names, only while that transfer is live, only at block indices the transfer expects (never a
prefix-cache block shared with other requests), and only after its checksum verified. A transfer completes
when the sender's `done` arrives, the chunk count matches and every expected block of every layer arrived.
Deadlines are leases: each verified chunk renews them, and so does each `alive` record, which the sender
sends for every transfer it holds (queued behind other prompts, or producing) at least every third of the
lease: a long queue at a live sender is not a failure; a dead, hung or unreachable sender's leases lapse.
A receiver that holds lapsed transfers (`expire(hold=True)`: a decode worker under a conductor) keeps them
live, with no deadline, until it is told their fate (`resume`: the sender's process was heard, it is only
slow; `restart` under another sender; `drop`): chunks that arrive meanwhile still land, and a `done` still
completes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.transfer.base import TransferState


@dataclass
class Inbound:
    xfer: str
    request_id: str
    num_layers: int
    first_block: int  # block-table index of the first block to arrive (blocks before it were cached here)
    num_blocks: int  # blocks that must arrive, per layer
    timeout_s: float
    deadline_s: float
    state: TransferState = TransferState.RESERVED
    started_s: float = field(default_factory=time.monotonic)
    num_chunks: int = 0
    num_bytes: int = 0
    first_token: int | None = None  # sampled by the prefill worker, from its `done`
    logprobs: dict | None = None  # its logprobs and the prompt's, when asked for (`done`'s "logprobs")
    lapsed: bool = False  # its lease ran out and it is held live (no deadline) until it is told its fate
    lapses: int = 0  # how many times its lease ran out (a renewed one may lapse again)
    _masks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._masks = [0] * self.num_layers

    @property
    def complete(self) -> bool:
        full = (1 << self.num_blocks) - 1
        return all(m == full for m in self._masks)

    def mark(self, layer: int, first: int, count: int) -> None:
        rel = first - self.first_block
        self._masks[layer] |= ((1 << count) - 1) << rel


class InboundTransfers:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._live: dict[str, Inbound] = {}
        self._ended: list[Inbound] = []
        self._lapsed: list[Inbound] = []  # held live with their lease run out, not yet reported
        self.num_late_chunks = 0  # chunks of transfers that had already ended: dropped, never written
        self.num_renewals = 0  # leases renewed by `alive` records

    def expect(self, xfer: str, request_id: str, first_block: int, num_blocks: int, timeout_s: float) -> Inbound:
        inbound = Inbound(xfer, request_id, self.num_layers, first_block, num_blocks, timeout_s,
                          time.monotonic() + timeout_s)
        self._live[xfer] = inbound
        return inbound

    def get(self, xfer: str) -> Inbound | None:
        return self._live.get(xfer)

    def target(self, header: dict) -> Inbound | None:
        """The live transfer whose expected blocks this chunk names, or None: where it may be written."""
        inbound = self._live.get(header.get("xfer"))
        return inbound if inbound is not None and self._in_range(inbound, header) else None

    def _in_range(self, inbound: Inbound, header: dict) -> bool:
        layer, first, count = header.get("layer", -1), header.get("first", -1), header.get("count", 0)
        return (isinstance(layer, int) and isinstance(first, int) and isinstance(count, int)
                and 0 <= layer < self.num_layers and count > 0 and first >= inbound.first_block
                and first + count <= inbound.first_block + inbound.num_blocks)

    def accept_chunk(self, header: dict, verified: bool) -> Inbound | None:
        """Book a chunk that arrived: its live transfer if it counts, or None (dropped; a bad one — checksum
        mismatch or blocks the transfer does not expect — fails its transfer)."""
        inbound = self._live.get(header.get("xfer"))
        if inbound is None:
            self.num_late_chunks += 1
            return None
        layer, first, count = header.get("layer", -1), header.get("first", -1), header.get("count", 0)
        in_range = self._in_range(inbound, header)
        if not verified:
            self._end(inbound, TransferState.FAILED_CHECKSUM)
            return None
        if not in_range:
            self._end(inbound, TransferState.FAILED_PEER)
            return None
        inbound.state = TransferState.IN_FLIGHT
        inbound.mark(layer, first, count)
        inbound.num_chunks += 1
        inbound.num_bytes += header.get("nbytes", 0)
        if not inbound.lapsed:  # (a held one keeps no deadline until it is told its fate)
            inbound.deadline_s = time.monotonic() + inbound.timeout_s
        return inbound

    def renew(self, xfer: str | None) -> None:
        """The sender still holds this transfer (an `alive` record): its lease starts over."""
        inbound = self._live.get(xfer)
        if inbound is not None and not inbound.lapsed:
            inbound.deadline_s = time.monotonic() + inbound.timeout_s
            self.num_renewals += 1

    def reject(self, header: dict) -> None:
        """A chunk that could not be placed: late (dropped, counted) or malformed (fails its transfer)."""
        inbound = self._live.get(header.get("xfer"))
        if inbound is None:
            self.num_late_chunks += 1
        else:
            self._end(inbound, TransferState.FAILED_PEER)

    def on_done(self, header: dict, vocab_size: int) -> None:
        """The sender's last word: complete only with every block of every layer, the chunk count and a
        first token in [0, vocab_size)."""
        inbound = self._live.get(header.get("xfer"))
        if inbound is None:
            return
        token = header.get("first_token")
        ok = (inbound.complete and header.get("num_chunks") == inbound.num_chunks and isinstance(token, int)
              and 0 <= token < vocab_size)
        inbound.first_token = token if ok else None
        extra = header.get("logprobs")
        inbound.logprobs = extra if ok and isinstance(extra, dict) else None
        self._end(inbound, TransferState.COMPLETED if ok else TransferState.FAILED_INCOMPLETE)

    def fail(self, xfer: str, state: TransferState) -> None:
        inbound = self._live.get(xfer)
        if inbound is not None:
            self._end(inbound, state)

    def complete_now(self, xfer: str) -> None:
        """Nothing had to arrive (every prompt token but the last was in this worker's prefix cache): no
        first token either, the decode worker computes the last prompt token itself."""
        self.fail(xfer, TransferState.COMPLETED)

    def restart(self, old: str, new: str) -> Inbound | None:
        """The same blocks, from another sender: `old` is dropped unended (its late chunks are rejected) and
        `new` expects every block again. Returns the old transfer (None if it had ended)."""
        inbound = self.drop(old)
        if inbound is not None:
            self.expect(new, inbound.request_id, inbound.first_block, inbound.num_blocks, inbound.timeout_s)
        return inbound

    def abort_request(self, request_id: str) -> None:
        for inbound in [t for t in self._live.values() if t.request_id == request_id]:
            self._end(inbound, TransferState.ABORTED)

    def expire(self, now: float | None = None, hold: bool = False) -> None:
        """End the transfers whose lease ran out before `now` (FAILED_TIMEOUT), or with `hold` keep them live
        and lapsed, with no deadline, for `take_lapsed` (their fate: `resume`, `restart` or `drop`)."""
        now = time.monotonic() if now is None else now
        for inbound in [t for t in self._live.values() if t.deadline_s < now]:
            if not hold:
                self._end(inbound, TransferState.FAILED_TIMEOUT)
                continue
            inbound.state, inbound.lapsed, inbound.deadline_s = TransferState.FAILED_TIMEOUT, True, float("inf")
            self._lapsed.append(inbound)

    def take_lapsed(self) -> list[Inbound]:
        """Transfers held live since their lease ran out, each returned once."""
        lapsed, self._lapsed = self._lapsed, []
        return lapsed

    def resume(self, xfer: str) -> bool:
        """A held lapsed transfer gets a lease again (its sender is alive, only slow). False if it had ended."""
        inbound = self._live.get(xfer)
        if inbound is None or not inbound.lapsed:
            return False
        inbound.lapsed, inbound.deadline_s = False, time.monotonic() + inbound.timeout_s
        return True

    def drop(self, xfer: str) -> Inbound | None:
        """Forget a live transfer without ending it (its fate is decided elsewhere; late chunks are rejected).
        Returns it, or None if it had ended."""
        return self._live.pop(xfer, None)

    def take_ended(self) -> list[Inbound]:
        ended, self._ended = self._ended, []
        return ended

    def __len__(self) -> int:
        return len(self._live)

    def _end(self, inbound: Inbound, state: TransferState) -> None:
        inbound.state = state
        del self._live[inbound.xfer]
        self._ended.append(inbound)
