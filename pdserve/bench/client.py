"""One benchmark request against any OpenAI-compatible endpoint: stream it, time every chunk, never raise.

Prompts are token ids sent through `/v1/completions` (exact lengths for the served tokenizer; vLLM and
pdserve both accept them). Output length is forced with `max_tokens` + `ignore_eos` (a vLLM extension that
pdserve also honours) and checked against the `usage` the server reports. Any failure (HTTP status, broken
stream, timeout, connection refused) ends up in the record's `error`, counted in the report. A request with a
`service_tier` sends it in the body and keeps it on its record; an HTTP 429 answer (refused on arrival: SLO
unattainable or queue full) is marked `rejected`, counted apart from errors.
"""

from __future__ import annotations

import json
import time

import httpx

from pdserve.bench.metrics import RequestRecord

TIER_PRIORITY = {"priority": 0, "default": 1, "flex": 2}  # `priority` sent with a tier


async def send_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                       temperature: float = 0.0, ignore_eos: bool = True,
                       service_tier: str | None = None) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    if service_tier is not None:
        # and vLLM's equivalent, for servers that only know `--scheduling-policy priority` (lower first)
        body.update(service_tier=service_tier, priority=TIER_PRIORITY[service_tier])
    start = time.monotonic()
    times: list[float] = []
    usage: dict = {}
    error = None
    rejected = False
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rejected = resp.status_code == 429
                error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
            else:
                async for line in resp.aiter_lines():
                    error = _on_line(line, times, usage) or error
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    end = time.monotonic()
    n_out = usage.get("completion_tokens", len(times))
    if error is None and not times:
        error = "no tokens received"
    return RequestRecord(start_s=start, first_token_s=times[0] if times else None, token_times=times, end_s=end,
                         prompt_tokens=usage.get("prompt_tokens", len(prompt)), output_tokens=n_out, error=error,
                         service_tier=service_tier, rejected=rejected)


def _on_line(line: str, times: list[float], usage: dict) -> str | None:
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        return f"bad stream chunk: {data[:80]}"
    if "error" in chunk:
        return f"stream error: {chunk['error'].get('message', chunk['error'])}"
    if chunk.get("usage"):
        usage.update(chunk["usage"])
    choices = chunk.get("choices") or []
    if choices and (choices[0].get("text") or choices[0].get("delta", {}).get("content")):
        times.append(time.monotonic())
    return None


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"][:200]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")
