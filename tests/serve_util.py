"""Start `pdserve serve` as a real process for tests, and read its Prometheus metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.bench.netns import reap
from pdserve.bench.server_proc import free_port, scrape_metrics, wait_ready

_BESIDE = Path(__file__).resolve().parents[2] / "shared" / "traces"  # a checkout next to shared/
# the public traces: `$PDSERVE_TRACES`, else `shared/traces` next to the repository, else /work/shared/traces
# (where a clone elsewhere on this machine finds them); tests that need one skip where it is absent
TRACES = Path(os.environ.get("PDSERVE_TRACES") or (_BESIDE if _BESIDE.is_dir() else "/work/shared/traces"))


def wait_for(read, ok=bool, timeout_s: float = 10.0, every_s: float = 0.1):
    """`read()` polled until `ok` of its value holds or `timeout_s` passed: the last value read (assert on it;
    never sleep a fixed time and then assert)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if ok(value) or time.monotonic() >= deadline:
            return value
        time.sleep(every_s)


class Server:
    def __init__(self, *args: str, env: dict | None = None, timeout_s: float = 300) -> None:
        self.args = args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = "unused"
        # the server's and its workers' output goes to a file, not a pipe nobody reads: a full pipe would
        # block whichever process writes next
        self.log = tempfile.NamedTemporaryFile(prefix="pdserve-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        why = wait_ready(self.proc, self.url, timeout_s)
        if why is not None:
            out = self.output()
            self.stop()
            raise RuntimeError(f"server {why}: {out}")

    def output(self) -> str:
        """What the server and its workers printed so far."""
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        return scrape_metrics(self.url)

    def wait_metric(self, name: str, ok, timeout_s: float = 10.0, **labels) -> float:
        """The metric once `ok` of it holds (the workers' stats reach the gateway every 0.25 s), else its last
        value after `timeout_s` (the caller's assert then fails on it)."""
        return wait_for(lambda: self.metric(name, **labels), ok, timeout_s)

    def metric(self, name: str, **labels) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return sum(v for (n, lab), v in self.metrics().items()
                   if n == name and all(dict(lab).get(k) == val for k, val in labels.items()))

    def worker_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def worker_pid(self, name: str) -> int:
        """The pid of worker `name` ("decode-0"): its spec JSON, name first, is on its command line."""
        for pid in self.worker_pids():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f'{{"name": "{name}"'.encode() in f.read():
                    return pid
        raise LookupError(f"no live worker {name}")

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()
            if os.path.exists(self.log.name):
                os.unlink(self.log.name)


@contextmanager
def across_netns(ns, *args: str, env: dict, name: str = "decode-ns") -> Iterator[Server]:
    """A gateway and its prefill worker in this namespace, a decode worker `name` joining from the network
    namespace `ns` (`pdserve.bench.netns.Netns`) over its veth: every KV byte and the control plane cross it
    (tcp transport). `env` holds the deployment secret both sides need. `args`: more `pdserve serve` flags."""
    control = free_port()
    log = tempfile.NamedTemporaryFile(prefix=f"pdserve-{name}-", suffix=".log", delete=False)
    worker = ns.join_worker(f"tcp://{ns.host_ip}:{control}", name, env=env, log=log)
    try:
        # every decode worker joins: until the one across the veth has, the gateway is not serving
        server = Server("--transport", "tcp", "--decode", "0", "--control-port", str(control), "--control-host",
                        ns.host_ip, "--data-host", ns.host_ip, "--num-threads", "1", *args, env=env)
    except RuntimeError:
        worker.kill()
        raise RuntimeError(open(log.name, errors="replace").read()) from None
    server.netns_worker = worker
    server.control = f"tcp://{ns.host_ip}:{control}"  # where more workers join
    try:
        yield server
    finally:
        server.stop()
        reap(worker)
        os.unlink(log.name)
