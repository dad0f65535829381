"""Open-loop replay of a workload against an endpoint, and the rate sweep behind goodput.

Each request is sent at its arrival time whatever happened to earlier ones (open loop: a slow server does
not slow the arrivals down), unless a concurrency limit is given (closed loop, for fixed workloads). Requests
may each carry a service tier (`tiers`, from `pdserve.bench.tier_mix.workload_tiers`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdserve.bench.client import send_request
from pdserve.bench.metrics import RequestRecord
from pdserve.errors import InvalidRequestError
from pdserve.workloads import Workload


@dataclass(frozen=True)
class RunConfig:
    endpoint: str
    model: str
    concurrency: int | None = None
    temperature: float = 0.0
    timeout_s: float = 600.0
    progress: bool = True


def discover_model(endpoint: str, model: str | None, timeout_s: float = 10.0) -> str:
    """The model to ask for: `model` if given, else the endpoint's first. Fails clearly when unreachable."""
    url = endpoint.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise InvalidRequestError(f"cannot reach endpoint {endpoint}: {e or type(e).__name__}",
                                  param="endpoint") from e
    if resp.status_code != 200:
        raise InvalidRequestError(f"endpoint {endpoint} answered {resp.status_code} to GET /v1/models",
                                  param="endpoint")
    if model:
        return model
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError) as e:
        raise InvalidRequestError(f"endpoint {endpoint} lists no models", param="endpoint") from e


async def _run(workload: Workload, prompts: list[list[int]], cfg: RunConfig, label: str,
               tiers: list[str | None]):
    # Idle pooled connections are dropped after 2 s, before a server's keep-alive timeout (uvicorn's and
    # vLLM's: 5 s) closes them under a request just sent on one (it failed as a ReadError).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0)
    sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    records: list[RequestRecord | None] = [None] * len(prompts)
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not cfg.progress, transient=False) as bar:
        task = bar.add_task(label, total=len(prompts))
        async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as client:
            start = time.monotonic()

            async def one(i: int) -> None:
                spec = workload.requests[i]
                await asyncio.sleep(max(0.0, start + spec.arrival_s - time.monotonic()))
                if sem is None:
                    records[i] = await _send(client, cfg, prompts[i], spec.output_len, tiers[i])
                else:
                    async with sem:
                        records[i] = await _send(client, cfg, prompts[i], spec.output_len, tiers[i])
                bar.advance(task)

            await asyncio.gather(*(one(i) for i in range(len(prompts))))
            duration = time.monotonic() - start
    return [r for r in records if r is not None], duration, start


async def _send(client, cfg: RunConfig, prompt: list[int], max_tokens: int, tier: str | None) -> RequestRecord:
    return await send_request(client, cfg.endpoint, cfg.model, prompt, max_tokens, cfg.temperature,
                              service_tier=tier)


def run(workload: Workload, prompts: list[list[int]], cfg: RunConfig, label: str = "requests",
        tiers: list[str | None] | None = None):
    """Replay; returns (records in workload order, duration in s, start time on the monotonic clock).
    `tiers[i]` is the service tier request i asks for (None: send none)."""
    if tiers is None:
        tiers = [None] * len(prompts)
    if len(tiers) != len(prompts):
        raise ValueError(f"{len(tiers)} tiers for {len(prompts)} requests")
    return asyncio.run(_run(workload, prompts, cfg, label, tiers))
