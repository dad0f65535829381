"""What the conductor core keeps per request (`FlightState`: its stage, where it runs, its transfer, its tokens
so far) and per worker (`Backlog`: its queue as the conductor sees it).

A request's stage (`Stage`) changes only by `FlightState.advance`, along `TRANSITIONS`; a move the table
lacks raises `IllegalTransition`. The usual course, PD mode:

    NEW -> RESERVING -> DISPATCHED -> PREFILLED -> DECODING -> ENDED

with a detour while its decode worker has no room (RESERVING -> WAITING_ROOM [-> STAGING -> STAGED] ->
DISPATCHED); colocated, and in PD whenever the decode worker computes the prompt itself: NEW -> LOCAL_PREFILL
-> DECODING -> ENDED. A dead or hung prefill worker sends a prompt back (to RESERVING once its blocks are
reserved, else it waits on); a dead decode worker ENDs the request and a copy goes on from NEW (ORPHANED
while no worker can take it). Some moves come from races between two workers' events: a prompt moved off a
prefill worker (back to RESERVING) may still be reported prefilled by it, or stream its first token from KV
it had sent. Staying in a stage is no move (an event repeated). Timestamps (`dispatched_s`, `prefilled_s`,
...) stay data: the stage says where the request is, not when it got there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.conductor.consumption import Prediction
from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL


class Stage(enum.Enum):
    NEW = "new"  # admitted, not placed yet (or the copy of a request moving off a dead worker)
    RESERVING = "reserving"  # its decode worker is asked to reserve KV blocks (`Reserve`, or `Redirect`)
    WAITING_ROOM = "waiting_room"  # its decode worker has no room for its blocks yet (`reserve_waiting`)
    STAGING = "staging"  # meanwhile its idle prefill worker computes it ahead (`pdserve.conductor.staging`)
    STAGED = "staged"  # computed ahead: once dispatched, only its last token is left to compute
    DISPATCHED = "dispatched"  # blocks reserved; its prefill worker computes it and sends the KV (`Prefill`)
    PREFILLED = "prefilled"  # its prefill worker reported the prompt done; the KV is on its way
    LOCAL_PREFILL = "local_prefill"  # its decode (colocated) worker computes the prompt itself, or has it cached
    DECODING = "decoding"  # its first token came from where it runs now
    ORPHANED = "orphaned"  # a moved copy waiting for a worker to be ready (its own is being restarted)
    ENDED = "ended"  # finished, aborted, failed, or moved off a dead worker


TRANSITIONS: dict[Stage, frozenset[Stage]] = {
    Stage.NEW: frozenset({Stage.RESERVING, Stage.LOCAL_PREFILL, Stage.ORPHANED}),
    Stage.ORPHANED: frozenset({Stage.RESERVING, Stage.LOCAL_PREFILL, Stage.ENDED}),
    # (-> PREFILLED, DECODING: redirected, but the prefill worker it left had got there)
    Stage.RESERVING: frozenset({Stage.WAITING_ROOM, Stage.DISPATCHED, Stage.LOCAL_PREFILL, Stage.PREFILLED,
                                Stage.DECODING, Stage.ENDED}),
    # (-> RESERVING: its blocks were reserved just as its prefill worker hung: redirected)
    Stage.WAITING_ROOM: frozenset({Stage.STAGING, Stage.DISPATCHED, Stage.LOCAL_PREFILL, Stage.RESERVING,
                                   Stage.ENDED}),
    # (-> WAITING_ROOM: its pass was dropped, or its prefill worker died and another one takes the prompt)
    Stage.STAGING: frozenset({Stage.STAGED, Stage.WAITING_ROOM, Stage.DISPATCHED, Stage.LOCAL_PREFILL,
                              Stage.RESERVING, Stage.ENDED}),
    Stage.STAGED: frozenset({Stage.DISPATCHED, Stage.WAITING_ROOM, Stage.LOCAL_PREFILL, Stage.RESERVING,
                             Stage.ENDED}),
    # (-> DECODING: its KV landed before its prefill worker's report; -> RESERVING: that worker died or hung;
    # -> LOCAL_PREFILL: the transfer failed and the decode worker recomputes)
    Stage.DISPATCHED: frozenset({Stage.PREFILLED, Stage.LOCAL_PREFILL, Stage.RESERVING, Stage.DECODING,
                                 Stage.ENDED}),
    Stage.PREFILLED: frozenset({Stage.LOCAL_PREFILL, Stage.DECODING, Stage.ENDED}),  # (LOCAL: KV never came whole)
    Stage.LOCAL_PREFILL: frozenset({Stage.DECODING, Stage.ENDED}),
    Stage.DECODING: frozenset({Stage.ENDED}),
    Stage.ENDED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A request was asked to move between stages that its lifecycle does not join (`TRANSITIONS`)."""


@dataclass
class FlightState:
    rid: str
    prompt: list
    params: dict
    tier: str
    arrival_s: float
    priority: int = 0
    pin: tuple | None = None
    sensitivity: str = DEFAULT_LABEL  # its KV's label (`pdserve.core.pd.sensitivity`)
    decode: str | None = None
    prefill: str | None = None
    xfer: str = ""
    queued_tokens: int = 0  # prompt tokens it adds to its prefill worker's backlog until prefilled
    dispatched_s: float | None = None  # PD: when its prefill command went out
    prefilled_s: float | None = None  # PD: when the prefill worker reported the prompt done
    prefilled_by: str | None = None  # PD: that prefill worker
    lapsed_s: float | None = None  # PD: when its transfer's lease first lapsed (`Recovery.lease_lapsed`)
    gave_up: bool = False  # PD: its prefill worker's latest report gave up on delivering its KV (`prefilled`)
    predicted_ttft_s: float | None = None  # admission's prediction, checked at its first token (then None)
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    prediction: Prediction | None = None  # PD: of its KV's first consumption
    kv_addr: str | None = None  # PD: where its reserved blocks take KV (known once reserved)
    first_block: int = 0
    outputs: list = field(default_factory=list)  # the token ids streamed so far (all of them, across moves)
    offset: int = 0  # of them, streamed before it moved to where it runs now (its prompt there: + these)
    checkpoint: int = 0  # tokens (of prompt + outputs) whose KV its decode worker reported on disk
    restore: dict | None = None  # {peer, tokens}: it moved off dead `peer`, whose checkpoint it resumes from
    _stage: Stage = field(default=Stage.NEW, init=False)  # (a copy made by `dataclasses.replace` starts NEW)

    @property
    def stage(self) -> Stage:
        return self._stage

    def advance(self, new: Stage) -> None:
        """Move to stage `new` (staying where it is is no move); `IllegalTransition` if `TRANSITIONS` has no
        such move."""
        if new is not self._stage and new not in TRANSITIONS[self._stage]:
            raise IllegalTransition(f"request {self.rid}: no move from {self._stage.name} to {new.name}")
        self._stage = new

    @property
    def resumed_prompt(self) -> list:
        """What it computes where it runs now: the prompt, and the outputs streamed before it moved there."""
        return self.prompt + self.outputs[:self.offset] if self.offset else self.prompt

    def request_fields(self) -> dict:
        """The fields of the commands that carry it (generate, reserve, prefill, stage: `pdserve.conductor.wire`):
        its prompt where it runs now, and what is left of its tokens."""
        params = self.params
        if self.offset:
            params = {**params, "max_tokens": params["max_tokens"] - self.offset}
            if params.get("grammar"):  # (its matcher takes the outputs it moved with first)
                params["grammar_replay"] = self.offset
        return {"rid": self.rid, "prompt": self.resumed_prompt, "params": params, "priority": self.priority,
                "pin": self.pin, "tier": self.tier, "sensitivity": self.sensitivity}


@dataclass
class Backlog:
    """The conductor's own view of one worker's queue: prompt tokens routed there and not yet prefilled, by
    tier rank; requests decoding there."""
    tokens: dict = field(default_factory=lambda: {0: 0, 1: 0})
    dispatched: dict = field(default_factory=lambda: {0: 0, 1: 0})  # of those, sent to the prefill worker
    decoding: int = 0
    since: float | None = None  # when its current prefill step is taken to have begun (None: not known yet)

    def arriving(self, now: float) -> None:
        """A prompt is about to be queued here: an idle worker starts on it now."""
        if not any(self.tokens.values()):
            self.since = now

    def stepped(self, now: float) -> None:
        """A prompt came out prefilled here: its step ended, the next one (if any is queued) begins."""
        self.since = now

    def busy_s(self, now: float) -> float | None:
        """How long the current step has run, as far as the conductor's clock saw its start."""
        return None if self.since is None else max(now - self.since, 0.0)
