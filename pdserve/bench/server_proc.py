"""Waiting for an OpenAI-compatible server process to come up, and reading its Prometheus metrics: what the
benchmark scripts and the tests that start real servers (pdserve, vLLM) share."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, path: str = "/health",
               poll_s: float = 0.3) -> str | None:
    """Poll `url + path` until it answers 200. None once it does; otherwise why not ("exited with N" when
    `proc` ended, "not ready in T s" past `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            if httpx.get(url + path, timeout=max(poll_s, 1.0)).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return f"not ready in {timeout_s:g} s"
        time.sleep(poll_s)


def scrape_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of `url`/metrics: (name, sorted label pairs) -> value."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
