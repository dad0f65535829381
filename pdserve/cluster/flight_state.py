"""What the conductor core keeps per request (`FlightState`: where it runs, its transfer, its tokens so far)
and per worker (`Backlog`: its queue as the conductor sees it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.cluster.consumption import Prediction


@dataclass
class FlightState:
    rid: str
    prompt: list
    params: dict
    tier: str
    arrival_s: float
    priority: int = 0
    pin: tuple | None = None
    decode: str | None = None
    prefill: str | None = None
    xfer: str = ""
    queued_tokens: int = 0  # prompt tokens it adds to its prefill worker's backlog until prefilled
    dispatched_s: float | None = None  # PD: when its prefill command went out
    prefilled_s: float | None = None  # PD: when the prefill worker reported the prompt done
    prefilled_by: str | None = None  # PD: that prefill worker
    lapsed_s: float | None = None  # PD: when its transfer's lease first lapsed (`_lease_lapsed`)
    gave_up: bool = False  # PD: its prefill worker gave up on delivering its KV (`prefilled` failed)
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    prediction: Prediction | None = None  # PD: of its KV's first consumption
    kv_addr: str | None = None  # PD: where its reserved blocks take KV (known once reserved)
    first_block: int = 0
    waiting_room: bool = False  # PD: its decode worker had no room for its blocks when asked
    staged: str = ""  # PD: "staging" (computed ahead on its prefill worker) -> "staged" (done there)
    outputs: list = field(default_factory=list)  # the token ids streamed so far (all of them, across moves)
    offset: int = 0  # of them, streamed before it moved to where it runs now (its prompt there: + these)
    started: bool = False  # where it runs now has streamed its first token
    checkpoint: int = 0  # tokens (of prompt + outputs) whose KV its decode worker reported on disk
    restore: dict | None = None  # {peer, tokens}: it moved off dead `peer`, whose checkpoint it resumes from

    @property
    def resumed_prompt(self) -> list:
        """What it computes where it runs now: the prompt, and the outputs streamed before it moved there."""
        return self.prompt + self.outputs[:self.offset] if self.offset else self.prompt

    def request_fields(self) -> dict:
        """The fields of the commands that carry it (generate, reserve, prefill, stage: `pdserve.cluster.wire`):
        its prompt where it runs now, and what is left of its tokens."""
        params = self.params
        if self.offset:
            params = {**params, "max_tokens": params["max_tokens"] - self.offset}
            if params.get("grammar"):  # (its matcher takes the outputs it moved with first)
                params["grammar_replay"] = self.offset
        return {"rid": self.rid, "prompt": self.resumed_prompt, "params": params, "priority": self.priority,
                "pin": self.pin, "tier": self.tier}


@dataclass
class Backlog:
    """The conductor's own view of one worker's queue: prompt tokens routed there and not yet prefilled, by
    tier rank; requests decoding there."""
    tokens: dict = field(default_factory=lambda: {0: 0, 1: 0})
    dispatched: dict = field(default_factory=lambda: {0: 0, 1: 0})  # of those, sent to the prefill worker
    decoding: int = 0
