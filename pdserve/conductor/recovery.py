"""When a worker dies or hangs: its requests and prompts go on elsewhere, with nothing lost or changed.

**A dead prefill worker** (`prefill_gone`), or one whose transfer's lease lapsed (`lease_lapsed`: alive but
silent, so it is marked stalled until it reports again): its prompts move to another usable prefill worker
(`redirect`: the decode worker keeps its reserved blocks and expects the KV under a new transfer id; its
`reserved` for that id sends the prompt to the new worker, which so never sends before it is expected),
unless recomputing on the decode worker is predicted faster or no prefill worker is left (`kv_failed`); each
choice is counted (`kv_recovery{choice}`). A lapse whose sender's process was heard within `HEARD_S` (its
heartbeat thread beats while its loop is busy: a long step of another prompt, a slow pass) is not a hang: the
decode worker, which kept the transfer live, is told to `renew` its lease, for up to `MAX_RENEW_S` after
its first lapse (`kv_lease_extensions{worker}`); a stopped or frozen process is heard from no more.

**A dead decode (or colocated) worker** (`decode_gone`): the conductor core keeps every token each request has
streamed (`FlightState.outputs`). When its decode worker dies, the request moves: it is routed again (no
admission: it was admitted once, and a refusal now would lose it) and placed on a live worker as if it had
just arrived with the prompt + the outputs so far as its prompt and what is left of `max_tokens`
(`FlightState.offset` marks the split; `resumed_prompt`). In PD mode a prefill worker recomputes that whole
context and sends its KV; the token it samples is the next one of the stream, at the same sequence position,
so a greedy request's text is the one an undisturbed run gives and a seeded one keeps its seed's stream
(`pdserve.model.sampler`: draws keyed by seed and position). The tokens the new worker streams are numbered
from `offset` on (the gateway's driver adds it), so the client's stream goes on with no duplicate or missing
token. With a disk KV tier, its decode worker reports checkpoints (`checkpointed`: the first N tokens' KV is
on disk, `pdserve.engine.checkpoints`); a request with one moves with `restore` = {dead worker, N}: the worker
taking it adopts those blocks from the dead one's disk folder and computes only the rest itself, no prefill
worker. Counted: `requests_migrated{reason, source}` (`source`: `checkpoint` or `recompute`). With no live
worker to take it, or when the driver cannot tell which tokens were streamed (a simulator reports only some),
the request ends with an explicit 503, unless its worker is being restarted: then it waits for a worker to be
ready (`orphans`, placed by `adopt_orphans` when the core hears a `ready`), and fails only if none will be.

`Recovery` owns the orphans; it sees the core's `Books` (`pdserve.conductor.books`: the flights, workers and
backlog, routing, and the moves that keep their counts) and admission's step models.
"""

from __future__ import annotations

import dataclasses

from pdserve.conductor.actions import Count, Fail, Send, stale
from pdserve.conductor.admission import Admission
from pdserve.conductor.books import Books
from pdserve.conductor.flight_state import FlightState, Stage
from pdserve.conductor.wire import Abort, KvFailed, Redirect, Renew
from pdserve.core.sched.online_fit import MIN_SAMPLES

HEARD_S = 1.0  # a worker heard from this recently (two heartbeats) is running, however busy its loop
# How long after its first lapse a transfer's lease is still renewed for a sender that is heard yet sends
# nothing: the supervisor's bound for a wedged main loop at its defaults (6 x the 20 s heartbeat timeout),
# beyond which a loop still heartbeating is taken for stuck, not busy.
MAX_RENEW_S = 120.0


class Recovery:
    """The conductor core's recovery part. Owns the requests waiting for a worker (`orphans`); sees the core's
    `Books` (its flights, workers, backlog, routing and the moves that keep their counts) and admission's
    step models (to predict where a prompt is computed sooner)."""

    def __init__(self, books: Books, admission: Admission | None) -> None:
        self.books, self.admission = books, admission
        self.orphans: list[FlightState] = []  # moved off a dead worker, waiting for one to be ready

    def worker_gone(self, name: str, reason: str, restarting: bool) -> list:
        """Worker `name` is gone (died, hung, left; `restarting`: it is being started again): its requests and
        prompts move to the others."""
        actions: list = []
        for f in list(self.books.flights.values()):
            if f.decode == name:
                actions += self.decode_gone(f, reason, restarting)
            elif f.prefill == name:
                actions += self.prefill_gone(f)
        if self.orphans and not restarting and self.books.route(())[0] is None:
            actions += self._fail_orphans()  # no worker that could take them is alive, and this one stays dead
        return actions

    def decode_gone(self, f: FlightState, reason: str, restarting: bool = False) -> list:
        """Move `f` off its dead decode worker; `restarting`: that worker is being started again, so with no
        live worker to take it now the request waits for one (`orphans`, placed by `adopt_orphans`)."""
        dead, prefill = f.decode, f.prefill
        if len(f.outputs) < f.num_tokens:
            return self.books.fail(f, 503, f"worker {dead} died while serving this request", "worker_died")
        actions = [Send(prefill, Abort(f.rid))] if prefill not in (None, dead) else []
        self.books.finish(f)
        restore = {"peer": dead, "tokens": f.checkpoint} if f.checkpoint else f.restore  # (an earlier one's)
        moved = dataclasses.replace(
            f, decode=None, prefill=None, xfer="", queued_tokens=0, dispatched_s=None, prefilled_s=None,
            prediction=None, kv_addr=None, first_block=0, offset=len(f.outputs),
            outputs=list(f.outputs), checkpoint=0, restore=restore,
            # the client has had the prompt's logprobs with the first token: not computed again
            params={k: v for k, v in f.params.items() if k != "prompt_logprobs"} if f.outputs else f.params)
        hashes = self.books.affinity(moved.resumed_prompt)
        source = "checkpoint" if restore else "recompute"
        actions.append(Count("requests_migrated", (("reason", reason), ("source", source))))
        first, second = self.books.route(hashes)
        if first is not None:  # (with no live prefill worker, the decode worker recomputes: `reserved`)
            return actions + self.books.place(moved, first, second, hashes)
        if restarting:
            moved.advance(Stage.ORPHANED)
            self.orphans.append(moved)
            return actions
        return actions[:-1] + [Fail(f.rid, 503, f"worker {dead} died while serving this request and no live "
                                    "worker is left to move it to", "worker_died")]

    def checkpointed(self, rid: str, worker: str, tokens: int) -> list:
        """`worker` has the KV of the first `tokens` tokens of `rid` (prompt + outputs) on disk
        (`pdserve.engine.checkpoints`): should it die, the request resumes from there."""
        f = self.books.flights.get(rid)
        if f is None or f.decode != worker:
            return stale("checkpointed")  # ended, or moved off `worker`
        if tokens > f.checkpoint:
            f.checkpoint = tokens
            return [Count("kv_checkpoints", (("worker", worker),))]
        return []

    def adopt_orphans(self) -> list:
        """A worker is ready (again): the requests waiting for one are placed."""
        actions, waiting, self.orphans = [], self.orphans, []
        for f in waiting:
            hashes = self.books.affinity(f.resumed_prompt)
            first, second = self.books.route(hashes)
            if first is None:
                self.orphans.append(f)
            else:
                actions += self.books.place(f, first, second, hashes)
        return actions

    def forget(self, rid: str) -> None:
        """`rid`, waiting for a worker, was aborted (its client left)."""
        for f in self.orphans:
            if f.rid == rid:
                f.advance(Stage.ENDED)
        self.orphans = [o for o in self.orphans if o.rid != rid]

    def _fail_orphans(self) -> list:
        """No worker that could take them is coming back."""
        waiting, self.orphans = self.orphans, []
        for f in waiting:
            f.advance(Stage.ENDED)
        return [Fail(f.rid, 503, "its worker died and no live worker is left to move it to", "worker_died")
                for f in waiting]

    def prefill_gone(self, f: FlightState, reason: str = "prefill_gone") -> list:
        """Its prefill worker died or stalled: move the prompt to another usable prefill worker, unless none is
        left or the decode worker would recompute it sooner (both predicted by admission's step models;
        `reason`: the recompute's, as its usage reports it)."""
        books = self.books
        books.release_prefill(f)
        hashes = books.affinity(f.resumed_prompt)
        other = books.pick("prefill", hashes)
        tokens = len(f.resumed_prompt)
        if other is not None and self.admission is not None:
            there = self.admission.predict_ttft_s(other.name, f.decode, tokens, sum(books.backlog[other.name]
                                                  .dispatched.values()), 0, 0)
            decode = self.admission.model(f.decode)  # its fit knows prefill only if it ran some
            here = decode.prefill_s(tokens) if decode.prefill_steps() >= MIN_SAMPLES else None
            if there is not None and here is not None and here < there:
                other = None  # recomputing is predicted faster
        if other is None:
            f.advance(Stage.LOCAL_PREFILL)
            return [Count("kv_recovery", (("choice", "recompute"),)),
                    Send(f.decode, KvFailed(f.xfer, reason))]
        f.prefill, f.dispatched_s = other.name, None
        other.outstanding += 1
        f.queued_tokens = max(tokens - other.prefix_blocks(hashes) * books.block_size, 1)
        books.backlog[other.name].tokens[books.tiers[f.tier].rank] += f.queued_tokens
        actions: list = [Count("kv_recovery", (("choice", "redispatch"),))]
        if f.kv_addr is not None:  # its blocks are reserved: a new transfer into them, from the new worker,
            # sent once the decode worker expects it (its `reserved` for the new id dispatches the prompt)
            old, f.xfer, f.lapsed_s, f.gave_up = f.xfer, books.new_xfer(f.rid), None, False
            actions.append(Send(f.decode, Redirect(old, f.xfer)))
            f.advance(Stage.RESERVING)
        elif f.stage in (Stage.STAGING, Stage.STAGED):  # what it staged died with it
            f.advance(Stage.WAITING_ROOM)
        return actions

    def lease_lapsed(self, f: FlightState, xfer: str, now: float) -> list:
        """Its prefill worker sent nothing for the lease: heard lately (busy), the lease is renewed; else (hung,
        stopped, unreachable) it is stalled, routing passes it by until it reports again, and the prompt moves
        to another prefill worker unless recomputing on the decode worker is predicted faster or none is left
        (`prefill_gone`)."""
        if f.stage is Stage.LOCAL_PREFILL:
            return []  # its decode worker was already told to recompute it (`send_failed`)
        sender = None if f.gave_up else self.books.workers.get(f.prefill or f.prefilled_by or "")
        if f.lapsed_s is None:
            f.lapsed_s = now
        if (sender is not None and sender.alive and sender.heard_s is not None and now - sender.heard_s <= HEARD_S
                and now - f.lapsed_s <= MAX_RENEW_S):  # busy, not hung: what it sends meanwhile still lands
            return [Count("kv_lease_extensions", (("worker", sender.name),)),
                    Send(f.decode, Renew(xfer))]
        if f.prefill is None:  # prefilled, yet its KV never arrived whole: only the decode worker can help
            f.advance(Stage.LOCAL_PREFILL)
            return [Count("kv_recovery", (("choice", "recompute"),)),
                    Send(f.decode, KvFailed(xfer, "failed_timeout"))]
        stalled = self.books.workers[f.prefill]
        stalled.stalled = True
        return ([Count("kv_leases_lapsed", (("worker", stalled.name),)), Send(stalled.name, Abort(f.rid))]
                + self.prefill_gone(f, "failed_timeout"))

    def send_failed(self, f: FlightState) -> list:
        """Its prefill worker prefilled the prompt but gave up on sending its KV (a send failed: the decode
        worker unreachable on its transport, the link broken): the decode worker, which still waits for that
        KV, recomputes it now instead of after its lease lapses."""
        f.advance(Stage.LOCAL_PREFILL)
        return [Count("kv_recovery", (("choice", "recompute"),)),
                Send(f.decode, KvFailed(f.xfer, "failed_send"))]
