"""The two value types every workload source produces and the load generator consumes.

A `Workload` is just a list of `RequestSpec`s (when to send, how long the prompt is, how many tokens to ask
for, and for Mooncake traces which prefix blocks the prompt is made of) plus a `description` that records
every transformation applied, so a benchmark report can say exactly what was replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestSpec:
    """One request to send.

    arrival_s: seconds from the start of the run (after time scaling) at which to send it.
    input_len / output_len: prompt tokens and tokens to generate (after length scaling and caps), both >= 1.
    hash_ids: Mooncake block ids (equal ids = equal prompt blocks, so shared prefixes), else None.
    """

    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None


@dataclass
class Workload:
    """Requests sorted by arrival, a short name, and a description of everything applied (for the report).

    `description["length_scale"]` is read by `build_prompts` to scale the Mooncake block size.
    """

    requests: list[RequestSpec]
    name: str
    description: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """Arrival time of the last request (0.0 for an empty workload)."""
        return self.requests[-1].arrival_s if self.requests else 0.0
