"""`pdserve serve` as a real process for benchmark scripts, its output in a log file (a pipe nobody reads
could fill up), its process group stopped at the end. Imported by the scripts beside it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pdserve.bench.server_proc import free_port, scrape_metrics, wait_ready

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


class Server:
    def __init__(self, args: list[str], log: Path, timeout_s: float = 300) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [*PDSERVE, "serve", "--port", str(self.port), *args]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        why = wait_ready(self.proc, self.url, timeout_s)
        if why is not None:
            self.stop()
            raise RuntimeError(f"server {why}, see {log}")

    def warm_up(self) -> None:
        """One short untimed request (the first step after start-up is slow)."""
        import httpx
        model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": list(range(1000, 1032)), "max_tokens": 4, "ignore_eos": True}
        httpx.post(self.url + "/v1/completions", json=body, timeout=300).raise_for_status()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        return scrape_metrics(self.url)

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
