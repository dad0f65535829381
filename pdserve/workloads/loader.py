"""`load_workload`: turn a workload spec string plus scaling options into a `Workload`.

Specs (`scheme:argument`):
* `mooncake:PATH`  Mooncake JSONL; arrivals from its timestamps; keeps `hash_ids` for prefix-sharing prompts.
* `azure:PATH`     Azure LLM inference CSV; arrivals relative to the earliest TIMESTAMP.
* `lengths:PATH`   length-only CSV; rows are taken in a *seeded shuffle* (a random permutation from `seed`, so a
                   small sample is representative rather than the head of the file; if `num_requests` exceeds
                   the rows, further independent permutations are appended), with arrivals generated at `rate`.
* `fixed:IN,OUT`   `num_requests` identical requests, arrivals generated at `rate`, or all at t=0 when rate is
                   None (the runner then limits concurrency instead).

Order of operations: read -> arrivals (trace time / time_scale, or generated at rate) -> stable sort by arrival
-> keep the first `max_requests` -> lengths * length_scale (rounded, minimum 1) -> clip to the caps (counted over
the kept requests). Mooncake `hash_ids` are kept as they are; `build_prompts` scales the block size instead.

Options that would be silently ignored are errors instead: `rate`, `num_requests`, `arrival`/`cv` for
timestamped traces, and `time_scale` for generated arrivals (set `rate` instead). Every problem raises
`InvalidRequestError` with a one-line message.
"""

from __future__ import annotations

import math
import os

import numpy as np

from pdserve.errors import InvalidRequestError
from pdserve.workloads.arrivals import check_arrival, generate_arrivals
from pdserve.workloads.readers import TraceRecord, read_azure, read_lengths, read_mooncake
from pdserve.workloads.spec import RequestSpec, Workload

TRACE_READERS = {"mooncake": read_mooncake, "azure": read_azure}
SCHEMES = ("mooncake", "azure", "lengths", "fixed")
SAMPLING = "seeded shuffle"


def _positive_int(value: int | None, name: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")


def _positive_number(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidRequestError(f"{name} must be a positive number, got {value!r}")


def _check_options(rate, arrival, cv, num_requests, length_scale, time_scale, max_requests, max_input_len,
                   max_output_len, seed) -> None:
    if rate is not None:
        _positive_number(rate, "rate")
    _positive_number(length_scale, "length_scale")
    _positive_number(time_scale, "time_scale")
    for value, name in ((num_requests, "num_requests"), (max_requests, "max_requests"),
                        (max_input_len, "max_input_len"), (max_output_len, "max_output_len")):
        _positive_int(value, name)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidRequestError(f"seed must be a non-negative integer, got {seed!r}")
    check_arrival(arrival, cv)


def _parse_fixed(arg: str) -> tuple[int, int]:
    parts = arg.split(",")
    try:
        n_in, n_out = (int(p) for p in parts)
        if n_in < 1 or n_out < 1:
            raise ValueError
    except ValueError:
        raise InvalidRequestError(f"fixed: expects IN,OUT as two positive integers (e.g. fixed:512,128), "
                                  f"got {arg!r}") from None
    return n_in, n_out


def _sample_rows(records: list[TraceRecord], n: int | None, rng: np.random.Generator) -> list[TraceRecord]:
    """`n` rows (all when None) in a seeded shuffle, cycling through fresh permutations if n > len(records)."""
    n = len(records) if n is None else n
    perms = [rng.permutation(len(records)) for _ in range(-(-n // len(records)))]
    return [records[i] for i in np.concatenate(perms)[:n]]


def _trace_source(scheme: str, path: str, rate, arrival, cv, num_requests, time_scale):
    """(records, arrival times, description) for a timestamped trace."""
    for bad, name in ((rate is not None, "rate"), (num_requests is not None, "num_requests"),
                      (arrival != "poisson" or cv != 1.0, "arrival/cv")):
        if bad:
            raise InvalidRequestError(f"{name} does not apply to {scheme}: traces (arrivals come from their "
                                      "timestamps; use time_scale to speed them up and max_requests to shorten)")
    records = TRACE_READERS[scheme](path)
    times = np.array([r.time_s for r in records], dtype=float) / time_scale
    return records, times, {"source": path, "arrival": "trace timestamps"}


def _generated_source(scheme: str, arg: str, rate, arrival, cv, num_requests, time_scale, seed):
    """(records, arrival times, description) for `lengths:` and `fixed:`, whose arrivals we generate."""
    if time_scale != 1.0:
        raise InvalidRequestError(f"time_scale applies to timestamped traces only; for {scheme}: set rate instead")
    desc: dict = {}
    if scheme == "lengths":
        if rate is None:
            raise InvalidRequestError("lengths: workloads need a request rate (rate=..., requests per second)")
        rows = read_lengths(arg)
        desc.update(source=arg, sampling=SAMPLING, records_read=len(rows))
        records = _sample_rows(rows, num_requests, np.random.default_rng([seed, 0]))
    else:
        if num_requests is None:
            raise InvalidRequestError("fixed: workloads need num_requests (how many requests to send)")
        n_in, n_out = _parse_fixed(arg)
        records = [TraceRecord(None, n_in, n_out, None)] * num_requests
    if rate is None:
        if arrival != "poisson" or cv != 1.0:
            raise InvalidRequestError("arrival/cv need a rate; without one every request arrives at t=0")
        desc.update(arrival="all at t=0", rate=None)
        return records, np.zeros(len(records)), desc
    times = generate_arrivals(len(records), rate, np.random.default_rng([seed, 1]), arrival=arrival, cv=cv)
    desc.update(arrival=arrival, rate=rate, **({"cv": cv} if arrival == "gamma" else {}))
    return records, times, desc


def _scale_length(n: int, scale: float, cap: int | None) -> tuple[int, bool]:
    """(scaled and capped length, whether the cap clipped it)."""
    n = max(1, round(n * scale))
    return (cap, True) if cap is not None and n > cap else (n, False)


def _build_requests(records, times, length_scale, max_input_len, max_output_len):
    """RequestSpecs for already-ordered records, plus how many inputs and outputs were clipped."""
    requests, clipped_in, clipped_out = [], 0, 0
    for rec, t in zip(records, times):
        n_in, c_in = _scale_length(rec.input_len, length_scale, max_input_len)
        n_out, c_out = _scale_length(rec.output_len, length_scale, max_output_len)
        clipped_in, clipped_out = clipped_in + c_in, clipped_out + c_out
        requests.append(RequestSpec(float(t), n_in, n_out, rec.hash_ids))
    return requests, clipped_in, clipped_out


def _summary(requests: list[RequestSpec], clipped_in: int, clipped_out: int) -> dict:
    """What was kept, for the report (readers and the option checks guarantee at least one request)."""
    return {"records_kept": len(requests), "clipped_input": clipped_in, "clipped_output": clipped_out,
            "duration_s": requests[-1].arrival_s,
            "mean_input_len": float(np.mean([r.input_len for r in requests])),
            "mean_output_len": float(np.mean([r.output_len for r in requests]))}


def _split_spec(spec: str) -> tuple[str, str]:
    scheme, sep, arg = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or scheme not in SCHEMES:
        raise InvalidRequestError(f"unknown workload {spec!r} (expected mooncake:PATH, azure:PATH, lengths:PATH "
                                  "or fixed:IN,OUT)")
    if not arg:
        raise InvalidRequestError(f"workload {spec!r} lacks its {'IN,OUT' if scheme == 'fixed' else 'file path'}")
    return scheme, arg


def load_workload(spec: str, *, rate: float | None = None, arrival: str = "poisson", cv: float = 1.0,
                  num_requests: int | None = None, length_scale: float = 1.0, time_scale: float = 1.0,
                  max_requests: int | None = None, max_input_len: int | None = None,
                  max_output_len: int | None = None, seed: int = 0) -> Workload:
    """Read or generate a workload; see the module docstring for specs, order of operations and errors."""
    scheme, arg = _split_spec(spec)
    _check_options(rate, arrival, cv, num_requests, length_scale, time_scale, max_requests, max_input_len,
                   max_output_len, seed)
    if scheme in TRACE_READERS:
        records, times, desc = _trace_source(scheme, arg, rate, arrival, cv, num_requests, time_scale)
    else:
        records, times, desc = _generated_source(scheme, arg, rate, arrival, cv, num_requests, time_scale, seed)
    order = np.argsort(times, kind="stable")[:max_requests]
    kept = [records[i] for i in order]
    requests, clipped_in, clipped_out = _build_requests(kept, times[order], length_scale, max_input_len,
                                                        max_output_len)
    desc = {"spec": spec, "scheme": scheme, "records_read": len(records), **desc, "seed": seed,
            "time_scale": time_scale, "length_scale": length_scale, "num_requests": num_requests,
            "max_requests": max_requests, "max_input_len": max_input_len, "max_output_len": max_output_len,
            **_summary(requests, clipped_in, clipped_out)}
    name = f"{scheme}:{os.path.basename(arg) if scheme in ('mooncake', 'azure', 'lengths') else arg}"
    return Workload(requests=requests, name=name, description=desc)
