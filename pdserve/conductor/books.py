"""The conductor core's books: every request in flight, every worker's load, and the moves that keep the
counts between them consistent.

`Books` owns the tables the core's parts share — `flights` (rid -> `FlightState`), `workers` (name ->
`WorkerLoad`), `backlog` (name -> `Backlog`), `waiting` (tier -> requests placed that have not streamed a
token yet) — and the only code that moves a request's counts between workers: `place` (a request routed to
its workers: outstanding, backlog, remembered prefixes; the first command it needs), `release_prefill` (its
prefill worker's part is over: backlog and outstanding given back) and `finish` (it ended). The core
(`pdserve.conductor.conductor_core`) and its parts (`staging`, `recovery`, `membership`) read the tables and
call these moves; none of them adjusts another's counts by hand. Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from pdserve.conductor.actions import Fail, Send
from pdserve.conductor.flight_state import Backlog, FlightState, Stage
from pdserve.conductor.routing import AFFINITY_BLOCKS, MAX_POOL_BLOCKS, RecentBlocks, RoutingPolicy, WorkerLoad
from pdserve.conductor.ttft_routing import PairRequest
from pdserve.conductor.wire import Generate, Reserve
from pdserve.core.kvstore.block_hash import hash_blocks
from pdserve.core.service_tiers import ServiceTiers


class Books:
    def __init__(self, mode: str, policy: RoutingPolicy, tiers: ServiceTiers, block_size: int,
                 prefill_released: Callable[[str | None, str], None]) -> None:
        """`prefill_released(prefill, rid)`: told whenever `rid` lets go of its prefill worker (a stage pass of
        it running there is moot: `pdserve.conductor.staging.StagePlan.done`)."""
        self.mode, self.policy, self.tiers = mode, policy, tiers
        self.block_size = block_size  # (set from the workers' `ready`)
        self.flights: dict[str, FlightState] = {}
        self.workers: dict[str, WorkerLoad] = {}
        self.backlog: dict[str, Backlog] = {}
        self.waiting: dict[str, int] = {}
        self._prefill_released = prefill_released
        self._xfers = itertools.count()
        self.admission = None  # the core's `pdserve.conductor.admission.Admission` (a pair policy predicts with it)
        self.links: dict[str, dict[str, float]] = {}  # prefill -> decode -> measured bytes/s (its `kv_links`)
        self.pool = RecentBlocks()  # what the workers wrote to the shared pool lately (routing counts it for all)
        self.block_bytes = 0  # one KV block at the pool's codec (the workers' `ready`)
        self.notes: list[str] = []  # fallback kinds a pair policy took since the core last looked
        # KV bytes routed over each worker's port and not yet delivered (placed, no first token yet)
        self.port_bytes: dict[str, int] = {}
        self._transfers: dict[str, tuple[str, str, int]] = {}  # rid -> (prefill, decode, bytes)
        # prefill -> decode workers its KV paths' breakers hold open (`pdserve.core.pd.breaker`, its `kv_links`)
        self.open_paths: dict[str, set[str]] = {}

    # ---- workers and routing ------------------------------------------------------------------------------
    def add_worker(self, name: str, role: str, load: WorkerLoad | None = None) -> WorkerLoad:
        self.workers[name] = load or WorkerLoad(name, role)
        self.workers[name].pool = self.pool
        self.backlog[name] = Backlog()
        return self.workers[name]

    def pool_written(self, hashes) -> None:
        """Block hashes a worker wrote to the shared pool (its `kv_cache` event's `remote` part)."""
        if len(hashes):
            self.pool.add(np.asarray(list(dict.fromkeys(hashes)), np.uint64), MAX_POOL_BLOCKS)

    def role(self, role: str) -> list[WorkerLoad]:
        return [w for w in self.workers.values() if w.role == role]

    def pick(self, role: str, hashes) -> WorkerLoad | None:
        return self.policy.pick(self.role(role), hashes)

    def route(self, hashes, tokens: int | None = None, rank: int = 0, now: float | None = None
              ) -> tuple[WorkerLoad | None, WorkerLoad | None]:
        """(the decode or colocated worker, the prefill worker in PD mode). A pair policy
        (`pdserve.conductor.ttft_routing`) picks both at once when the prompt's length `tokens` is known."""
        pair = getattr(self.policy, "pick_pair", None)
        if pair is not None and self.mode == "pd" and tokens is not None:
            first, second, notes = pair(self, PairRequest(hashes, tokens, rank, now))
            self.notes.extend(notes)
            return self._around_open(first, second, hashes)
        first = self.pick("colocated" if self.mode == "colocated" else "decode", hashes)
        if self.mode != "pd" or first is None:
            return first, None
        return self._around_open(first, self.pick("prefill", hashes), hashes)

    def _around_open(self, first: WorkerLoad | None, second: WorkerLoad | None, hashes
                     ) -> tuple[WorkerLoad | None, WorkerLoad | None]:
        """A pair whose KV path is open (the prefill worker's breaker to that decode worker) is not used: the
        prefill worker kept (its cache may hold the prompt) with another decode worker, else the decode worker
        with another prefill worker; with neither, the pair as chosen (counted: `kv_path_open_no_pair`; its
        transfer fails at once and the decode worker recomputes)."""
        if first is None or second is None or first.name not in self.open_paths.get(second.name, ()):
            return first, second
        shut = self.open_paths[second.name]
        decoders = [w for w in self.role("decode") if w.usable and w.name not in shut]
        if decoders:
            self.notes.append("kv_path_open_rerouted")
            return self.policy.pick(decoders, hashes), second
        prefills = [w for w in self.role("prefill") if w.usable and first.name not in self.open_paths.get(w.name, ())]
        if prefills:
            self.notes.append("kv_path_open_rerouted")
            return first, self.policy.pick(prefills, hashes)
        self.notes.append("kv_path_open_no_pair")
        return first, second

    def affinity(self, prompt: list) -> list:
        """The block hashes of `prompt`'s head that routing matches against the workers' remembered prefixes."""
        return hash_blocks(prompt[:AFFINITY_BLOCKS * self.block_size], self.block_size)

    def new_xfer(self, rid: str) -> str:
        return f"{rid}#{next(self._xfers)}"

    # ---- a request's counts -------------------------------------------------------------------------------
    def place(self, f: FlightState, first: WorkerLoad, second: WorkerLoad | None, hashes) -> list:
        """Start `f` on the workers chosen for it: generate (colocated), or reserve blocks on `first` for the
        prompt `second` will prefill (PD)."""
        self.flights[f.rid] = f
        self.waiting[f.tier] = self.waiting.get(f.tier, 0) + 1
        f.decode = first.name
        producer = second if second is not None else first
        prompt = f.resumed_prompt
        f.queued_tokens = max(len(prompt) - producer.prefix_blocks(hashes) * self.block_size, 1)  # not cached
        self.backlog[producer.name].tokens[self.tiers[f.tier].rank] += f.queued_tokens
        unsent = len(prompt) - first.prefix_blocks(hashes) * self.block_size  # (before it is remembered there)
        first.outstanding += 1
        first.remember(hashes)
        restore = {"restore": f.restore} if f.restore else {}
        if self.mode == "colocated":
            f.advance(Stage.LOCAL_PREFILL)
            return [Send(first.name, Generate(**f.request_fields(), **restore))]
        f.xfer = self.new_xfer(f.rid)
        f.advance(Stage.RESERVING)
        if second is not None:
            f.prefill = second.name
            second.outstanding += 1
            self._transfer(f.rid, second.name, first.name, unsent)
            second.remember(hashes)
        return [Send(first.name, Reserve(**f.request_fields(), xfer=f.xfer, **restore))]

    def _transfer(self, rid: str, prefill: str, decode: str, tokens: int) -> None:
        nbytes = max(-(-tokens // self.block_size), 0) * self.block_bytes
        self._transfers[rid] = (prefill, decode, nbytes)
        for w in (prefill, decode):
            self.port_bytes[w] = self.port_bytes.get(w, 0) + nbytes

    def delivered(self, rid: str) -> None:
        """`rid`'s KV is delivered (its first token came) or will not be: its bytes leave the ports' counts."""
        prefill, decode, nbytes = self._transfers.pop(rid, (None, None, 0))
        for w in (prefill, decode):
            if w is not None:
                self.port_bytes[w] -= nbytes

    def release_prefill(self, f: FlightState) -> None:
        """`f`'s prompt no longer waits for its prefill worker (prefilled, recomputed or cached on its decode
        worker, moved, ended): what it added to that worker's backlog and outstanding count is given back."""
        self._prefill_released(f.prefill, f.rid)
        if f.queued_tokens:
            producer = f.prefill or f.decode
            rank = self.tiers[f.tier].rank
            self.backlog[producer].tokens[rank] -= f.queued_tokens
            if f.dispatched_s is not None:
                self.backlog[producer].dispatched[rank] -= f.queued_tokens
            f.queued_tokens = 0
        if f.prefill is not None:
            self.workers[f.prefill].outstanding -= 1
            f.prefill = None

    def finish(self, f: FlightState) -> None:
        """`f` ended (finished, aborted, failed, or moved: a copy goes on); a second call does nothing."""
        if self.flights.pop(f.rid, None) is None:
            return
        self.delivered(f.rid)
        self.release_prefill(f)
        if f.stage is Stage.DECODING:
            self.backlog[f.decode].decoding -= 1
        else:
            self.waiting[f.tier] -= 1
        self.workers[f.decode].outstanding -= 1
        f.advance(Stage.ENDED)

    def fail(self, f: FlightState, status: int, message: str, code: str) -> list:
        self.finish(f)
        return [Fail(f.rid, status, message, code)]
