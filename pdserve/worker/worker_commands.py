"""What the real worker does with each command for a request or a transfer (`pdserve.conductor.commands`): it
makes the request from the command's fields (`LLMEngine.make_request`) and hands it to its engine, its
prefill side (`PrefillSide`) or its decode side (`DecodeSide`)."""

from __future__ import annotations

from pdserve.conductor.wire import (Abort, Generate, KvFailed, PeerGone, Prefill, Redirect, Renew, Reserve, Stage,
                                  Unpin, Warm)
from pdserve.core.pd.sensitivity import check_label
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.service_tiers import SERVICE_TIERS
from pdserve.errors import InvalidRequestError


class WorkerCommands:
    def __init__(self, engine, prefill, decode, reports) -> None:
        """`prefill` / `decode`: the worker's sides (None where its role has none); `reports`: its
        `WorkerReports` (a redirected transfer is reported reserved again)."""
        # (named apart from the commands: `prefill` is a command, `self.prefill_side` the side that runs it)
        self.engine, self.prefill_side, self.decode_side, self.reports = engine, prefill, decode, reports

    def generate(self, cmd: Generate) -> None:
        restore = cmd.restore
        if restore and self.decode_side.checkpoints is not None:
            # the adopted blocks are found as prefix hits below; what is missing is computed here, counted
            tokens = restore["tokens"]
            adopted = self.decode_side.checkpoints.adopt(restore["peer"], cmd.prompt[:tokens])
            self.decode_side.stats.checkpoint_fallbacks += adopted < tokens
            self.decode_side.books.restored(cmd.rid, adopted)
        req = self.engine.make_request(cmd.rid, cmd.prompt, SamplingParams(**cmd.params), cmd.priority,
                                       pin=_pin(cmd.pin), service_tier=_tier(cmd.tier),
                                       sensitivity=check_label(cmd.sensitivity))
        self.engine.scheduler.add_request(req)

    def reserve(self, cmd: Reserve) -> None:
        self.decode_side.reserve(cmd.rid, cmd.prompt, SamplingParams(**cmd.params), cmd.xfer, cmd.priority,
                            _pin(cmd.pin), _tier(cmd.tier), cmd.restore, check_label(cmd.sensitivity))

    def prefill(self, cmd: Prefill) -> None:
        self.prefill_side.add(cmd.rid, cmd.prompt, SamplingParams(**cmd.params), cmd.dest, cmd.xfer, cmd.first_block,
                         cmd.priority, _pin(cmd.pin), _tier(cmd.tier), link=cmd.link, deadline_in_s=cmd.deadline_in_s,
                              read_in_s=cmd.read_in_s, sensitivity=check_label(cmd.sensitivity))

    def stage(self, cmd: Stage) -> None:
        self.prefill_side.stage(cmd.rid, cmd.prompt, SamplingParams(**cmd.params), cmd.priority, _tier(cmd.tier),
                                check_label(cmd.sensitivity))

    def warm(self, cmd: Warm) -> None:
        self.prefill_side.warm(cmd.rid, cmd.prompt, check_label(cmd.sensitivity))

    def abort(self, cmd: Abort) -> None:
        self.engine.abort([cmd.rid])
        if self.decode_side is not None:
            self.decode_side.abort(cmd.rid)
        if self.prefill_side is not None:
            self.prefill_side.finish(cmd.rid, prefilled=False)
            self.prefill_side.drop_stage(cmd.rid)

    def kv_failed(self, cmd: KvFailed) -> None:
        self.decode_side.peer_failed(cmd.xfer, cmd.reason)

    def renew(self, cmd: Renew) -> None:  # its sender was heard: busy, not hung
        self.decode_side.renew(cmd.xfer)

    def redirect(self, cmd: Redirect) -> None:
        """Expected anew: once reported reserved, the conductor sends the prompt to its new prefill worker."""
        inbound = self.decode_side.redirect(cmd.old, cmd.xfer)
        if inbound is not None:
            self.reports.reserved(inbound.request_id, inbound.xfer, inbound.first_block, True)

    def unpin(self, cmd: Unpin) -> None:
        self.engine.block_manager.unpin(f"prewarm:{cmd.id}")

    def peer_gone(self, cmd: PeerGone) -> None:
        if self.prefill_side is not None:
            self.prefill_side.peer_gone(cmd.addr)


def _pin(pin) -> tuple[str, float] | None:
    return None if pin is None else (str(pin[0]), float(pin[1]))


def _tier(tier: str | None) -> str:
    tier = tier or "default"
    if tier not in SERVICE_TIERS:
        raise InvalidRequestError(f"unknown service tier {tier!r}", param="service_tier")
    return tier
