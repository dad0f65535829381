"""`pdserve serve` as a real process for benchmark scripts, its output in a log file (a pipe nobody reads
could fill up), its process group stopped at the end. Imported by the scripts beside it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], log: Path, timeout_s: float = 300) -> None:
        import httpx
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [*PDSERVE, "serve", "--port", str(self.port), *args]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}), see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not ready in {timeout_s} s, see {log}")
            time.sleep(0.3)

    def warm_up(self) -> None:
        """One short untimed request (the first step after start-up is slow)."""
        import httpx
        model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": list(range(1000, 1032)), "max_tokens": 4, "ignore_eos": True}
        httpx.post(self.url + "/v1/completions", json=body, timeout=300).raise_for_status()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families
        out = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
