"""Mooncake (`pip install 'pdserve[mooncake]'`, package `mooncake-transfer-engine-non-cuda`): whether it can be
used here, and a pool of our own for `--kv-remote local` and the tests.

Its Python modules (`mooncake.store`, `mooncake.engine`) load Debian's `libibverbs1` even when only TCP is used;
`unavailable()` says what is missing and how to install it. The master (`mooncake_master`, installed beside the
Python it came with) runs the store's bookkeeping and, here, its HTTP metadata server too
(`-enable_http_metadata_server`); the pool's memory is a store server's (`mooncake_client -global_segment_size`),
so it outlives any one worker (a worker lends none unless told to: a segment dies with its process, and the
blocks in it). Every listener is on the address it is given (loopback by default).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

INSTALL = ("pip install 'pdserve[mooncake]' (mooncake-transfer-engine-non-cuda) and, on Debian or Ubuntu, "
           "apt-get install libibverbs1")


def unavailable() -> str | None:
    """None when Mooncake's store and transfer engine import here; else why not and how to install them."""
    try:
        import mooncake.engine  # noqa: F401
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"Mooncake is not usable here ({e}); install it: {INSTALL}"
    if master_binary() is None:
        return f"mooncake_master was not found beside {sys.executable} or on PATH; install it: {INSTALL}"
    return None


def master_binary() -> str | None:
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if beside.exists() else shutil.which("mooncake_master")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Master:
    """A `mooncake_master` process with its HTTP metadata server, on `host`, and the store servers that hold the
    pool's memory (`servers`); `stop()` ends them."""
    proc: subprocess.Popen
    host: str
    rpc_port: int
    metadata_port: int
    servers: list = field(default_factory=list)

    @property
    def address(self) -> str:
        """The master's RPC address, as a store client's `master_server_address` takes it."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def url(self) -> str:
        """As `--kv-remote` takes it: mooncake://HOST:PORT?metadata=URL."""
        return f"mooncake://{self.address}?metadata={self.metadata_url}"

    def add_server(self, pool_bytes: int, log: Path | None = None, timeout_s: float = 20.0) -> None:
        """A store server lending `pool_bytes` of memory to the pool (`mooncake_client`), ready when this returns."""
        port = free_port(self.host)
        argv = [_binary("mooncake_client"), f"-global_segment_size={pool_bytes}", f"-host={self.host}",
                f"-master_server_address={self.address}", f"-metadata_server={self.metadata_url}", f"-port={port}",
                "-protocol=tcp"]
        proc = _spawn(argv, log)
        self.servers.append(proc)
        _wait_listening(proc, self.host, [port], timeout_s, self.stop, log)

    def stop(self, timeout_s: float = 10.0) -> None:
        for proc in [*self.servers, self.proc]:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def start_master(host: str = "127.0.0.1", log: Path | None = None, timeout_s: float = 20.0,
                 rpc_port: int | None = None, metadata_port: int | None = None, pool_bytes: int = 0) -> Master:
    """A master (and its metadata server) listening on `host`, ready to take clients, with a store server lending
    `pool_bytes` to the pool (0: none); RuntimeError if they do not start within `timeout_s` (the log says why)."""
    binary = _binary("mooncake_master")
    rpc, meta = rpc_port or free_port(host), metadata_port or free_port(host)
    argv = [binary, f"-rpc_port={rpc}", f"-rpc_address={host}", "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={host}", f"-http_metadata_server_port={meta}", f"-metrics_host={host}",
            f"-metrics_port={free_port(host)}"]
    master = Master(_spawn(argv, log), host, rpc, meta)
    _wait_listening(master.proc, host, [rpc, meta], timeout_s, master.stop, log)
    if pool_bytes:
        master.add_server(pool_bytes, log, timeout_s)
    return master


def _binary(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found; install it: {INSTALL}")
    return found


def _spawn(argv: list[str], log: Path | None) -> subprocess.Popen:
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "GLOG_minloglevel": "1"})


def _wait_listening(proc: subprocess.Popen, host: str, ports: list[int], timeout_s: float, stop,
                    log: Path | None) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(_listening(host, p) for p in ports):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop()
            raise RuntimeError(f"{Path(proc.args[0]).name} did not start (exit {proc.returncode})"
                               + (f"; see {log}" if log else ""))
        time.sleep(0.05)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False
