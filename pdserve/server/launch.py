"""`pdserve serve`: start the workers, wait until every one is ready, serve HTTP, and stop them all cleanly.

The gateway process binds one event socket (ipc) that every worker reports to; each worker binds its own
command socket (ipc) and, when it can receive KV, a data socket (ipc for shm headers, a loopback TCP port
for tcp). Worker output goes to `<run dir>/<worker>.log`; a worker that dies during start-up ends the
command with the tail of its log. Workers die with the gateway (PR_SET_PDEATHSIG), so no orphans remain.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import NamedTuple

from pdserve.worker.spec import WorkerSpec
from pdserve.core.cost import check_priced, parse_prices
from pdserve.core.pd.breaker import breaker_settings
from pdserve.core.kvstore import kv_codecs
from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL, LABELS, check_label
from pdserve.core.settings import (AdmissionSettings, CadenceSettings, CalibrationSettings, CodecGateSettings,
                                   DeliverySettings, MooncakeTransportSettings, RoutingSettings, SupervisionSettings,
                                   parse_link_share, pick, shared)
from pdserve.errors import InvalidRequestError
from pdserve import transfer
from pdserve.transfer import peer_auth


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None
    """Hugging Face model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct."""
    mode: str = "pd"
    """pd (separate prefill and decode workers) or colocated (each worker does both)."""
    prefill: int = 1
    """Prefill workers (pd mode)."""
    decode: int = 1
    """Decode workers (pd mode); 0 with --control-port: they all join (`pdserve worker --join`)."""
    instances: int = 1
    """Workers in colocated mode."""
    transport: str = "shm"
    """KV delivery between workers: shm (same host), tcp, mooncake (Mooncake Transfer Engine: pip install
    'pdserve[mooncake]'), or auto (shm and tcp; each transfer on the path measured fastest for its worker pair,
    the other taken when one fails)."""
    mooncake_protocol: str = shared(MooncakeTransportSettings, "mooncake_protocol")
    host: str = "127.0.0.1"
    """Interface the HTTP server binds."""
    port: int = 8000
    """HTTP port."""
    served_model_name: str | None = None
    """Model name clients send; default: the model directory's name."""
    routing: str = shared(RoutingSettings, "routing")
    max_body_bytes: int = 1 << 20
    """Largest accepted request body (413 above)."""
    api_key: tuple[str, ...] = ()
    """An API key: with any key given, /v1/* requests must send one as `Authorization: Bearer <key>` (401
    otherwise)."""
    api_keys_file: str | None = None
    """A file of API keys, one per line, each optionally followed by its default service tier and/or its KV's
    sensitivity label (`KEY flex`, `KEY secret`, `KEY flex secret`); blank lines and lines starting with # are
    skipped."""
    api_key_tier: str | None = None
    """The default service tier of the --api-key keys (and of every request when no key is set): what
    `service_tier` auto (or none) means; default: default."""
    kv_sensitivity: str = DEFAULT_LABEL
    """The sensitivity label of a request's KV when neither its API key (--api-keys-file) nor the request
    (`kv_sensitivity`) names one: public, internal or secret. On the tcp path secret KV is always encrypted,
    internal KV whenever it crosses hosts, public KV authenticated (not encrypted) when it crosses hosts
    (`pdserve.core.pd.sensitivity`)."""
    stream_timeout_s: float = 60.0
    """A streaming client that takes no data for this long (it stopped reading) is cut off and its request
    aborted, so a slow reader holds no growing buffer."""
    kv_remote_pool_gb: float = 1.0
    """--kv-remote local: the shared KV pool's memory, in GiB (a Mooncake store server started beside its master)."""
    kv_timeout_s: float = shared(SupervisionSettings, "kv_timeout_s")
    kv_send_timeout_s: float = shared(SupervisionSettings, "kv_send_timeout_s")
    kv_breaker_failures: int = shared(SupervisionSettings, "kv_breaker_failures")
    kv_breaker_cool_s: float = shared(SupervisionSettings, "kv_breaker_cool_s")
    kv_stage_grace_s: float = shared(SupervisionSettings, "kv_stage_grace_s")
    delivery: str = shared(DeliverySettings, "delivery")
    link_share: str | None = shared(DeliverySettings, "link_share")
    delivery_backlog_s: float = shared(DeliverySettings, "delivery_backlog_s")
    decode_cadence: str = shared(CadenceSettings, "decode_cadence")
    prefill_kv_cache_dtype: str | None = None
    """--kv-cache-dtype of the prefill workers only (pd mode); default: --kv-cache-dtype."""
    decode_kv_cache_dtype: str | None = None
    """--kv-cache-dtype of the decode workers only (pd mode), e.g. int8 under a prefill worker's auto: the
    decode worker transcodes the KV it receives; default: --kv-cache-dtype."""
    idle_prewarm: bool = shared(RoutingSettings, "idle_prewarm")
    link_gbps: float | None = shared(DeliverySettings, "link_gbps")
    kv_wire_dtype: str = shared(DeliverySettings, "kv_wire_dtype")
    ready_timeout_s: float = 600.0
    """How long to wait for every worker to load its model (at start; a restarted worker not ready by then is
    killed and started again after the next backoff)."""
    admission: str | None = shared(AdmissionSettings, "admission")
    admission_margin: float = shared(AdmissionSettings, "admission_margin")
    max_outstanding: int = shared(AdmissionSettings, "max_outstanding")
    calibration: str = shared(CalibrationSettings, "calibration")
    kv_codec_gate: str = shared(CodecGateSettings, "kv_codec_gate")
    max_queue: int | None = None
    """Most requests of one service tier waiting for their first token; more are refused at once with 429
    server_overloaded and Retry-After (default: no bound)."""
    restart_workers: bool = True
    """Start a dead (or hung) worker again, after a backoff of 1 s doubling per restart (at most 30 s)."""
    max_restarts: int = 5
    """Most times one worker is restarted; after that it stays dead."""
    heartbeat_timeout_s: float = 20.0
    """A ready worker that sent nothing (it reports every 0.25 s) for this long is killed as hung and its
    requests move to the others."""
    drain_timeout_s: float = shared(SupervisionSettings, "drain_timeout_s")
    control_port: int | None = None
    """Take workers that join (`pdserve worker --join tcp://HOST:PORT`) on this TCP port: the gateway's event
    socket listens there too, CurveZMQ-authenticated with the deployment secret, which must then be given
    (PDSERVE_DEPLOYMENT_SECRET, 64 hex digits, the same in every joining worker's environment); pd mode needs
    --transport tcp or auto (joined workers deliver KV over tcp); default: no joins."""
    control_host: str | None = None
    """Interface the --control-port listens on; default: --host."""
    data_host: str = "127.0.0.1"
    """Address this host's workers bind their KV receivers on and give their peers (tcp transport): this
    host's address on the network joined workers are on, when they run on other hosts."""
    role_switching: str = shared(RoutingSettings, "role_switching")
    role_switch_hold_s: float = 30.0
    """--role-switching auto: a move must look worth it this long in a row (a passing burst moves nothing)."""
    role_switch_cooldown_s: float = 120.0
    """--role-switching auto: no move that reverses the last one sooner than this after it completed."""
    cluster: str | None = None
    """ray or ray://HOST:PORT: run the deployment on a Ray cluster (RAY_ADDRESS or a new local cluster; or the
    cluster whose GCS is at HOST:PORT): the gateway as a Ray actor on this node, the workers as actors spread
    over the nodes, both restarted by Ray, the workers scaled live with POST/DELETE /v1/cluster/workers; KV
    over tcp; default: the gateway in this process, worker processes on this host."""
    otlp_endpoint: str | None = None
    """Export OpenTelemetry traces of requests (a span per phase: queue, prefill, transfer, decode; the
    client's `traceparent` continued) to this OTLP/HTTP collector, e.g. http://localhost:4318; default: off."""
    price_per_hour: tuple[str, ...] = ()
    """USD per worker-hour by role, ROLE=USD[,ROLE=USD] (roles: prefill, decode, colocated; a bare USD prices
    every role), e.g. prefill=2.5,decode=2.0: the workers' cost is counted in pdserve_cost_usd_total, split
    between the service tiers by the work each got (`pdserve.core.cost`); default: cost not measured."""

    def __post_init__(self) -> None:
        if self.mode not in ("pd", "colocated"):
            raise InvalidRequestError(f"--mode must be pd or colocated, got {self.mode!r}", param="mode")
        transfer.check(self.transport)
        for name in ("prefill", "decode", "instances", "max_body_bytes"):
            if getattr(self, name) < (0 if name == "prefill" or self._decode_may_join(name) else 1):
                raise InvalidRequestError(f"--{name.replace('_', '-')} must be positive", param=name)
        if self.api_key_tier not in (None, "priority", "default", "flex"):
            raise InvalidRequestError(f"--api-key-tier must be priority, default or flex, got {self.api_key_tier!r}",
                                      param="api_key_tier")
        check_label(self.kv_sensitivity)
        if not self.stream_timeout_s > 0:
            raise InvalidRequestError("--stream-timeout-s must be positive", param="stream_timeout_s")
        if not self.kv_remote_pool_gb > 0:
            raise InvalidRequestError("--kv-remote-pool-gb must be positive", param="kv_remote_pool_gb")
        if self.max_queue is not None and self.max_queue < 1:
            raise InvalidRequestError("--max-queue must be positive", param="max_queue")
        if self.max_restarts < 0 or not self.heartbeat_timeout_s > 0:
            raise InvalidRequestError("--max-restarts must be >= 0 and --heartbeat-timeout-s positive")
        for settings in (DeliverySettings, AdmissionSettings, CalibrationSettings, CadenceSettings, SupervisionSettings,
                         RoutingSettings, CodecGateSettings, MooncakeTransportSettings):
            pick(settings, self)
        for name in ("prefill_kv_cache_dtype", "decode_kv_cache_dtype"):
            if getattr(self, name) is not None:
                kv_codecs.check(getattr(self, name), name)
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise InvalidRequestError(f"--otlp-endpoint must be an http:// or https:// URL, got {self.otlp_endpoint!r}",
                                      param="otlp_endpoint")
        if self.cluster is not None:
            from pdserve.worker.ray_workers import parse_cluster
            parse_cluster(self.cluster)
            if self.transport == "mooncake":  # (its workers join as actors: `launch_ray.gateway_config`)
                raise InvalidRequestError("--cluster ray delivers KV over tcp: --transport mooncake is not available "
                                          "there", param="transport")
        self._check_control()
        check_priced(self.prices, ("prefill", "decode") if self.mode == "pd" else ("colocated",))
        if self.role_switching == "auto" and self.mode != "pd":
            raise InvalidRequestError("--role-switching auto moves workers between prefill and decode: it needs "
                                      "--mode pd", param="role_switching")
        if not (self.role_switch_hold_s >= 0 and self.role_switch_cooldown_s >= 0):
            raise InvalidRequestError("--role-switch-hold-s and --role-switch-cooldown-s must be >= 0")
        if not 0 < self.port < 65536:
            raise InvalidRequestError(f"--port must be in 1..65535, got {self.port}", param="port")


    @property
    def prices(self) -> dict[str, float]:
        """--price-per-hour, parsed: {role: USD per worker-hour} (empty: cost not measured)."""
        return parse_prices(self.price_per_hour)

    def _decode_may_join(self, name: str) -> bool:
        """--decode 0: every decode worker joins (--control-port), the gateway starting at least a prefill one."""
        return name == "decode" and self.control_port is not None and self.prefill > 0

    def _check_control(self) -> None:
        if self.control_port is None:
            return
        if not 0 < self.control_port < 65536 or self.control_port == self.port:
            raise InvalidRequestError(f"--control-port must be in 1..65535 and not --port, got {self.control_port}",
                                      param="control_port")
        if not peer_auth.valid_secret(os.environ.get(peer_auth.ENV, "")):
            raise InvalidRequestError(f"--control-port needs the deployment secret that joining workers prove: set "
                                      f"{peer_auth.ENV} (64 hex digits, e.g. `openssl rand -hex 32`)",
                                      param="control_port")
        if self.mode == "pd" and not transfer.speaks(self.transport, "tcp"):
            across = " or ".join(n for n in transfer.names() if transfer.speaks(n, "tcp"))
            raise InvalidRequestError(f"--control-port in pd mode needs --transport {across}: workers that join "
                                      "deliver KV over tcp", param="control_port")


SERVE_FIELDS = {f.name for f in fields(ServeConfig)}


class KeyDefaults(NamedTuple):
    """What an API key's requests get when they do not say: a service tier and a KV sensitivity label (None:
    the server's default)."""
    tier: str | None
    sensitivity: str | None = None


def api_keys(cfg: ServeConfig) -> dict[str, KeyDefaults]:
    """Every accepted API key -> its defaults."""
    keys = {key: KeyDefaults(cfg.api_key_tier) for key in cfg.api_key}
    if cfg.api_keys_file is None:
        return keys
    try:
        lines = Path(cfg.api_keys_file).expanduser().read_text().splitlines()
    except OSError as e:
        raise InvalidRequestError(f"cannot read --api-keys-file {cfg.api_keys_file!r}: {e.strerror}",
                                  param="api_keys_file") from e
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        keys[fields[0]] = _key_line(fields[1:], number, cfg.api_key_tier)
    return keys


def _key_line(columns: list[str], number: int, tier: str | None) -> KeyDefaults:
    """A key's columns after the key: at most a tier and a label, in either order."""
    tiers = [c for c in columns if c in ("priority", "default", "flex")]
    labels = [c for c in columns if c in LABELS]
    if len(tiers) > 1 or len(labels) > 1 or len(tiers) + len(labels) != len(columns):
        raise InvalidRequestError(f"--api-keys-file line {number}: expected `KEY [priority|default|flex] "
                                  f"[{'|'.join(LABELS)}]`", param="api_keys_file")
    return KeyDefaults(tiers[0] if tiers else tier, labels[0] if labels else None)


def gateway_sampling_defaults(cfg: ServeConfig, engine: dict, model_dir: str | Path):
    """What the sampling fields a request leaves unset take (`--generation-config`, an engine field the workers
    ignore: the gateway fills requests in); a bad path or file: a one-line error."""
    from pdserve.core.settings import GenerationSettings, default_of
    from pdserve.model.generation_config import sampling_defaults
    choice = engine.get("generation_config") or default_of(GenerationSettings, "generation_config")
    return sampling_defaults(choice, cfg.model, model_dir)


def worker_specs(cfg: ServeConfig, model_dir: str, engine: dict, run_dir: str) -> list[WorkerSpec]:
    roles = (["prefill"] * cfg.prefill + ["decode"] * cfg.decode) if cfg.mode == "pd" else ["colocated"] * cfg.instances
    if engine.get("num_threads") is None:  # share the cores out; each worker is its own process
        engine = dict(engine, num_threads=max(1, (os.cpu_count() or 1) // len(roles)))
    counts: dict[str, int] = {}
    specs = []
    for role in roles:
        i = counts[role] = counts.get(role, -1) + 1
        name = f"{role}-{i}"
        codec = {"prefill": cfg.prefill_kv_cache_dtype, "decode": cfg.decode_kv_cache_dtype}.get(role)
        specs.append(WorkerSpec(name=name, role=role, model_dir=model_dir,
                                engine=engine if codec is None else dict(engine, kv_cache_dtype=codec),
                                cmd_addr=f"ipc://{run_dir}/{name}.cmd", event_addr=f"ipc://{run_dir}/events",
                                transport=cfg.transport, kv_addr=f"ipc://{run_dir}/{name}.kv", kv_host=cfg.data_host,
                                mooncake_protocol=cfg.mooncake_protocol,
                                kv_timeout_s=cfg.kv_timeout_s, delivery=cfg.delivery,
                                **breaker_settings(cfg),
                                link_share=parse_link_share(cfg.link_share),
                                link_bytes_s=cfg.link_gbps * 1e9 / 8 if cfg.link_gbps else None,
                                delivery_backlog_s=cfg.delivery_backlog_s, kv_wire_dtype=cfg.kv_wire_dtype,
                                decode_cadence=cfg.decode_cadence,
                                calibration=cfg.calibration))
    return specs


class WorkerProcesses:
    def __init__(self, specs: list[WorkerSpec], run_dir: str) -> None:
        self.specs = specs
        self.run_dir = Path(run_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        # the deployment's secret (tcp peers' hello, `pdserve.transfer.peer_auth`; CurveZMQ keys,
        # `pdserve.transfer.zmq_auth`): in the gateway's and the workers' environment, never on a command line
        os.environ.setdefault(peer_auth.ENV, peer_auth.new_secret())
        self.env = dict(os.environ)

    def start(self) -> None:
        for spec in self.specs:
            log = open(self.run_dir / f"{spec.name}.log", "wb")  # noqa: SIM115 - the child owns it
            self.procs[spec.name] = subprocess.Popen(
                [sys.executable, "-m", "pdserve.worker.worker", spec.to_json()], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env)
            log.close()

    def restart(self, name: str) -> None:
        """Start worker `name` again (its log goes on in the same file)."""
        spec = next(s for s in self.specs if s.name == name)
        log = open(self.run_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "pdserve.worker.worker", spec.to_json()],
                                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env)
        log.close()

    @property
    def engine(self) -> dict:
        return self.specs[0].engine

    def dead(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def replace(self, old: str, role: str) -> WorkerSpec:
        """Start a worker of `role` in place of `old` (which switched roles and left) -> its spec."""
        base = next((s for s in self.specs if s.role == role), None) or next(s for s in self.specs if s.name == old)
        name = f"{role}-{sum(1 for s in self.specs if s.role == role)}"
        run = str(self.run_dir)
        spec = replace(base, name=name, role=role, cmd_addr=f"ipc://{run}/{name}.cmd",
                       kv_addr=f"ipc://{run}/{name}.kv")
        self.specs.append(spec)
        self.restart(name)
        return spec

    def left(self, name: str) -> None:
        """A worker that joined left (nothing of ours to stop: it was not started here)."""

    def lost(self, name: str) -> None:
        """A worker that joined went silent (whoever started it starts it again)."""

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join((self.run_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def sigterm_as_interrupt() -> None:
    """SIGTERM stops `pdserve serve` as Ctrl-C does (a KeyboardInterrupt in the main thread: drain, then stop)."""
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
