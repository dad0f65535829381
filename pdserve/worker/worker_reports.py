"""What a worker reports to the gateway after each pass of its loop (`WorkerReports`, a part of
`pdserve.worker.worker.Worker`): on a decode worker, reservations granted (`reserved`) or left waiting,
transfers settled and the step that first read delivered KV (`consumed`); on every worker, the tokens its step
made; on a prefill worker, the prompts it prefilled, staged or gave up on (`prefilled`, `staged`) and the
landings that moved (`relanded`).

It sees the worker's engine, its prefill and decode sides (`PrefillSide` / `DecodeSide`, or None) and a
function that sends one event.
"""

from __future__ import annotations

import time

from collections.abc import Callable

from pdserve.conductor.wire import Consumed, Prefilled, Relanded, Reserved, ReserveWaiting, Staged, Tokens, Transfer


class WorkerReports:
    def __init__(self, emit: Callable[[object], None], name: str, engine, prefill, decode) -> None:
        self.emit, self.name, self.engine, self.prefill, self.decode = emit, name, engine, prefill, decode

    # ---- decode side ------------------------------------------------------------------------------------
    def reserved(self, rid: str, xfer: str, first_block: int, needs_prefill: bool) -> None:
        """Blocks are reserved and, with `needs_prefill`, the transfer `xfer` expected: its sender may start."""
        self.emit(Reserved(rid, xfer, first_block, self.decode.receiver.address, needs_prefill))

    def decode_bookkeeping(self) -> None:
        """Take what arrived; grant reservations, report those left waiting, settle ended transfers."""
        self.decode.receive(0)
        for g in self.decode.try_reserve():
            res = g.reservation
            self.reserved(res.request.request_id, res.xfer, g.first_block, g.needs_prefill)
        for rid, xfer in self.decode.newly_waiting():
            self.emit(ReserveWaiting(rid, xfer))
        for inbound, outcome, req in self.decode.settle():
            self.emit(Transfer(inbound.request_id, inbound.xfer, outcome, inbound.state.value, inbound.num_bytes,
                               time.monotonic() - inbound.started_s, self.name, inbound.lapses))
            if req is not None and inbound.first_token is not None:  # the prefill worker's first token
                self.emit(Tokens([{"rid": req.request_id, "i": 0, "t": inbound.first_token,
                                   "fin": req.status.finish_reason if req.is_finished else None,
                                   "cached": req.num_cached_prompt_tokens,
                                   "kv": self.decode.books.kv_usage(req.request_id, req.num_prompt_tokens,
                                                                    req.num_cached_prompt_tokens),
                                   "queue_s": _diff(req.scheduled_s, req.arrival_s), "prefill_s": None,
                                   **(inbound.logprobs or {})}], self.name))

    def consumed(self, began: float) -> None:
        """The step that just ran read delivered KV for the first time: when it began (the conductor checks
        its consumption prediction against it). Before the step's tokens: a request may end with them."""
        rids = self.decode.consumed(self.engine.last_scheduled)
        if rids:
            self.emit(Consumed([[rid, began] for rid in rids]))

    # ---- outputs ----------------------------------------------------------------------------------------
    def outputs(self, outputs) -> None:
        items = []
        for out in outputs:
            if self.prefill is not None:  # a prefill worker's requests end prefilled (or aborted)
                staged = self.prefill.stage_ended(out.request_id, out.finish_reason == "prefilled")
                if staged is not None:
                    self.emit(Staged(staged, out.finish_reason == "prefilled"))
                    continue
                self.prefill.drop_stage(out.request_id, out.num_cached_tokens)
                landing = self.prefill.landing_in_s(out.request_id)
                failed = self.prefill.finish(out.request_id, prefilled=out.finish_reason == "prefilled",
                                             first_token=out.token_ids[-1] if out.token_ids else None,
                                             logprobs=_logprobs(out) or None)
                self.emit(Prefilled(out.request_id, failed, landing, _diff(out.scheduled_s, out.arrival_s),
                                    _diff(out.prefilled_s, out.scheduled_s)))
                self.relanded()  # the others due on its link now share it with this one
                continue
            item = {"rid": out.request_id, "i": len(out.token_ids) - 1, "t": out.token_ids[-1],
                    "fin": out.finish_reason if out.finished else None, "cached": out.num_cached_tokens,
                    **_logprobs(out)}
            if len(out.token_ids) == 1:
                item.update(queue_s=_diff(out.scheduled_s, out.arrival_s),
                            prefill_s=_diff(out.prefilled_s, out.scheduled_s))
                if self.decode is not None:  # how its prompt KV arrived (`usage.kv_transfer`)
                    item["kv"] = self.decode.books.kv_usage(out.request_id, len(out.prompt_token_ids),
                                                            out.num_cached_tokens)
            items.append(item)
        if items:
            self.emit(Tokens(items, self.name))

    def relanded(self) -> None:
        """Prefilled transfers whose landing estimate moved (`PrefillSide.relanded`)."""
        moved = self.prefill.relanded()
        if moved:
            self.emit(Relanded([[rid, landing_in_s] for rid, landing_in_s in moved]))

    def cancel_failed_deliveries(self) -> None:
        for rid in self.prefill.failed_requests():
            self.prefill.keep(rid)  # its KV computed so far kept for a re-route (a grace period)
            self.engine.abort([rid])
            self.prefill.drop_stage(rid)
            failed = self.prefill.finish(rid, prefilled=False)
            self.emit(Prefilled(rid, failed))
        late, self.prefill.late_failures = self.prefill.late_failures, []
        for rid, failed in late:  # reported prefilled, then its sends failed: its decode worker still waits
            self.emit(Prefilled(rid, failed))


def _logprobs(out) -> dict:
    """The logprobs an output carries when asked for: its newest token's ("lp") and, with its first token,
    the prompt's ("plp")."""
    extra = {}
    if out.logprobs:
        extra["lp"] = out.logprobs[-1]
    if out.prompt_logprobs is not None and len(out.token_ids) == 1:
        extra["plp"] = out.prompt_logprobs
    return extra


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b
