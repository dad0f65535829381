"""Mooncake (`pip install 'pdserve[mooncake]'`, package `mooncake-transfer-engine-non-cuda`): whether it can be
used here, and a master of our own for `--kv-remote local` and the tests.

Its Python modules (`mooncake.store`, `mooncake.engine`) load Debian's `libibverbs1` even when only TCP is used;
`unavailable()` says what is missing and how to install it. The master (`mooncake_master`, installed beside the
Python it came with) runs the store's bookkeeping and, here, its HTTP metadata server too
(`-enable_http_metadata_server`), every listener on the address it is given (loopback by default).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
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
    """A `mooncake_master` process with its HTTP metadata server, on `host`; `stop()` ends it."""
    proc: subprocess.Popen
    host: str
    rpc_port: int
    metadata_port: int

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

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_master(host: str = "127.0.0.1", log: Path | None = None, timeout_s: float = 20.0,
                 rpc_port: int | None = None, metadata_port: int | None = None) -> Master:
    """A master (and its metadata server) listening on `host`, ready to take clients; RuntimeError if it does
    not start within `timeout_s` (its log says why)."""
    binary = master_binary()
    if binary is None:
        raise RuntimeError(f"mooncake_master not found; install it: {INSTALL}")
    rpc, meta = rpc_port or free_port(host), metadata_port or free_port(host)
    argv = [binary, f"-rpc_port={rpc}", f"-rpc_address={host}", "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={host}", f"-http_metadata_server_port={meta}", f"-metrics_host={host}",
            f"-metrics_port={free_port(host)}"]
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "GLOG_minloglevel": "1"})
    master = Master(proc, host, rpc, meta)
    deadline = time.monotonic() + timeout_s
    while not (_listening(host, rpc) and _listening(host, meta)):
        if proc.poll() is not None or time.monotonic() > deadline:
            master.stop()
            raise RuntimeError(f"mooncake_master did not start (exit {proc.returncode})"
                               + (f"; see {log}" if log else ""))
        time.sleep(0.05)
    return master


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False
