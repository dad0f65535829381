"""The conductor core's actions (`pdserve.conductor.conductor_core`): what its drivers carry out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Send:
    worker: str
    cmd: object  # a command (`pdserve.conductor.wire`)


@dataclass(frozen=True)
class Fail:
    rid: str
    status: int
    message: str
    code: str
    retry_after_s: float | None = None

    @property
    def event(self) -> dict:
        """The error event a request's stream ends with."""
        return {"type": "error", "status": self.status, "message": self.message, "code": self.code,
                "etype": "server_error" if self.status >= 500 else (
                    "rate_limit_error" if self.status == 429 else "invalid_request_error"),
                "retry_after_s": self.retry_after_s}


@dataclass(frozen=True)
class Count:
    metric: str
    labels: tuple = ()  # ((name, value), ...)


def stale(event: str) -> list:
    """An event for a request the core no longer tracks (it ended, or moved) or for a transfer it replaced:
    nothing to do but count it (`pdserve_conductor_stale_events_total{event}`)."""
    return [Count("conductor_stale_events", (("event", event),))]


@dataclass(frozen=True)
class Observe:
    metric: str
    labels: tuple
    value: float
    weight: int = 1


@dataclass(frozen=True)
class Level:
    """A gauge's current value (the role planner's view of demand, capacity and utilization)."""
    metric: str
    labels: tuple
    value: float


@dataclass(frozen=True)
class Switch:
    """Move `worker` to `role` (`--role-switching auto`): it is draining (no new work); once drained, the
    driver stops it and starts a worker of `role` in its place."""
    worker: str
    role: str
