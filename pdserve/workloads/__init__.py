"""Workloads for the load generator: trace readers, arrival processes, scaling and exact-length prompts.

Pure Python + numpy (never torch), so `pdserve bench` starts fast and runs on a client machine.

    wl = load_workload("mooncake:/path/trace.jsonl", time_scale=20, max_requests=500)
    prompts = build_prompts(wl, vocab_size=32000)   # exactly wl.requests[i].input_len ids each
"""

from __future__ import annotations

from pdserve.workloads.arrivals import ARRIVAL_PROCESSES, generate_arrivals
from pdserve.workloads.loader import SCHEMES, load_workload
from pdserve.workloads.prompts import block_size, build_prompts
from pdserve.workloads.spec import RequestSpec, Workload

__all__ = ["ARRIVAL_PROCESSES", "SCHEMES", "RequestSpec", "Workload", "block_size", "build_prompts",
           "generate_arrivals", "load_workload"]
