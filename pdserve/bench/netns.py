"""A second network namespace joined to this one by a veth pair with addresses of its own, optionally shaped
with `tc`: a real (kernel) link for the tests and benchmarks that run a decode worker across it
(`tests/test_netns_serve.py`, `tests/test_netns_delivery_serve.py`, `benchmarks/bench_netns_delivery.py`,
`benchmarks/bench_netns.py`). Needs root and iproute2 (`ip`, `tc`); `NetnsUnavailable` says why not.

The shaping is on the host side's egress, the way KV goes (prefill worker here -> decode worker there): a `tbf`
token bucket at the given rate; an added delay is `netem` on the other side's egress (the acks' way, so each
round trip gets it), where the kernel has netem (many CI kernels do not: `Shaping.delay_ms` is then 0 and
`Shaping.note` says so). `TxSampler` reads how busy the link really was from the device's own byte count."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


class NetnsUnavailable(RuntimeError):
    """No namespace or no shaping here: not root, no iproute2, or the kernel refused (the message says)."""


@dataclass(frozen=True)
class Shaping:
    rate_mbit: float
    delay_ms: float  # as set: 0 where netem is missing
    note: str = ""  # what could not be set

    def __str__(self) -> str:
        delay = f", {self.delay_ms:g} ms" if self.delay_ms else ""
        return f"tbf {self.rate_mbit:g} Mbit/s{delay}" + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class Netns:
    name: str
    link: str  # the host side of the veth: its egress carries the KV
    peer_link: str  # the namespace's side
    host_ip: str
    peer_ip: str

    def exec_argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def join_worker(self, control: str, name: str, role: str = "decode", env: dict | None = None, log=None
                    ) -> subprocess.Popen:
        """`pdserve worker --join control` (one torch thread) started inside the namespace: `ip netns exec`
        execs it, so the process is the worker itself (signals reach it). `env` is added to this one's."""
        argv = [sys.executable, "-m", "pdserve.cli", "worker", "--role", role, "--join", control, "--name", name,
                "--num-threads", "1"]
        return subprocess.Popen(self.exec_argv(argv), stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})

    def shape(self, rate_mbit: float, delay_ms: float = 0.0) -> Shaping:
        """The link at `rate_mbit` (KV's way) and `delay_ms` more round trip where netem exists; replaces any
        earlier shaping. Raises NetnsUnavailable when tbf cannot be set."""
        if shutil.which("tc") is None:
            raise NetnsUnavailable("shaping a link needs iproute2's `tc`")
        self.unshape()
        burst = max(64 << 10, int(rate_mbit * 1e6 / 8 / 250))  # at least one 4 ms tick's worth
        tbf = ["tc", "qdisc", "add", "dev", self.link, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
               "burst", str(burst), "latency", "100ms"]
        done = subprocess.run(tbf, capture_output=True, text=True)
        if done.returncode != 0:
            raise NetnsUnavailable(f"tc tbf on {self.link}: {done.stderr.strip()}")
        if not delay_ms:
            return Shaping(rate_mbit, 0.0)
        netem = self.exec_argv(["tc", "qdisc", "add", "dev", self.peer_link, "root", "netem", "delay",
                                f"{delay_ms:g}ms"])
        done = subprocess.run(netem, capture_output=True, text=True)
        if done.returncode != 0:
            return Shaping(rate_mbit, 0.0, f"no netem here, no added delay: {done.stderr.strip()}")
        return Shaping(rate_mbit, delay_ms)

    def ports(self, listening: bool) -> set[int]:
        """The local TCP ports of the namespace's listening (or established) sockets."""
        args = ["-ltnH"] if listening else ["-tnH", "state", "established"]
        out = subprocess.run(self.exec_argv(["ss", *args]), capture_output=True, text=True, check=True).stdout
        column = 3 if listening else 2  # (`state` drops the state column)
        return {int(line.split()[column].rpartition(":")[2]) for line in out.splitlines() if line.strip()}

    @contextmanager
    def blackholed(self, port: int) -> Iterator[None]:
        """Every packet to or from `port` inside the namespace dropped, without a reset or an error: a
        blackholed peer. Policy routing to a blackhole route (the local table's rule moved behind ours, so
        arriving packets are matched too; this needs no iptables, nft or tc drop action)."""
        steps = [["route", "replace", "blackhole", "default", "table", "77"]]
        if any(line.startswith("0:") for line in self._rules().splitlines()):  # (not moved by an earlier one)
            steps += [["rule", "add", "pref", "100", "lookup", "local"], ["rule", "del", "pref", "0"]]
        steps += [["rule", "add", "pref", "40", "sport", str(port), "ipproto", "tcp", "table", "77"],
                  ["rule", "add", "pref", "41", "dport", str(port), "ipproto", "tcp", "table", "77"]]
        for step in steps:
            subprocess.run(self.exec_argv(["ip", *step]), check=True, capture_output=True)
        try:
            yield
        finally:
            for pref in ("40", "41"):
                subprocess.run(self.exec_argv(["ip", "rule", "del", "pref", pref]), check=True, capture_output=True)

    def _rules(self) -> str:
        return subprocess.run(self.exec_argv(["ip", "rule", "show"]), capture_output=True, text=True).stdout

    def unshape(self) -> None:
        if shutil.which("tc") is None:
            return
        subprocess.run(["tc", "qdisc", "del", "dev", self.link, "root"], capture_output=True)
        subprocess.run(self.exec_argv(["tc", "qdisc", "del", "dev", self.peer_link, "root"]), capture_output=True)


def reap(worker: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Wait for a joined worker to leave (it does once its gateway is gone), else kill it."""
    try:
        worker.wait(timeout_s)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")


@contextmanager
def netns(tag: str | None = None) -> Iterator[Netns]:
    """A namespace and its veth pair for the duration (both removed after, shaping with them)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise NetnsUnavailable("network namespaces need root and iproute2's `ip`")
    pid = os.getpid()
    tag = tag or str(pid % 100000)
    name, here, there = f"pdserve-{tag}", f"pdh{tag}", f"pdw{tag}"
    net = f"10.{200 + pid % 50}.{pid % 250}"
    _ip("netns", "add", name)
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", name)
        _ip("addr", "add", f"{net}.1/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", name, "addr", "add", f"{net}.2/24", "dev", there)
        _ip("-n", name, "link", "set", there, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield Netns(name, here, there, f"{net}.1", f"{net}.2")
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


class TxSampler:
    """A device's own count of the bytes it sent (`/sys/class/net/DEV/statistics/tx_bytes`), sampled every
    `every_s` in a thread until `stop`: how busy the link really was, independent of what pdserve measures."""

    def __init__(self, dev: str, every_s: float = 0.05) -> None:
        self.path = Path(f"/sys/class/net/{dev}/statistics/tx_bytes")
        self.every_s = every_s
        self.samples: list[tuple[float, int]] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tx-{dev}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self.samples.append((time.monotonic(), int(self.path.read_text())))
            self._stopped.wait(self.every_s)

    def stop(self) -> TxSampler:
        self._stopped.set()
        self._thread.join()
        return self

    def busy(self, rate_mbit: float) -> tuple[float, float, int]:
        """(start, end, bytes) of the busy period: from the first to the last interval in which the device
        sent more than a tenth of `rate_mbit` (what it sent meanwhile, idle intervals included)."""
        floor = 0.1 * rate_mbit * 1e6 / 8
        moving = [(t0, t1) for (t0, b0), (t1, b1) in zip(self.samples, self.samples[1:]) if b1 - b0 > floor * (t1 - t0)]
        if not moving:
            return 0.0, 0.0, 0
        start, end = moving[0][0], moving[-1][1]
        sent = [b for t, b in self.samples if start <= t <= end]
        return start, end, sent[-1] - sent[0]

    def utilization(self, rate_mbit: float) -> float | None:
        """Bytes sent over the busy period / what `rate_mbit` carries in it (None: never busy)."""
        start, end, sent = self.busy(rate_mbit)
        return sent / (rate_mbit * 1e6 / 8 * (end - start)) if end > start else None
