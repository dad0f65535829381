"""The gateway's event loop: conductor + worker readiness + worker-death monitor + uvicorn, in one process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import uvicorn
import zmq
import zmq.asyncio

from pdserve.conductor.admission import Admission
from pdserve.server.conductor_driver import Conductor
from pdserve.conductor.wire import Shutdown
from pdserve.worker.wire_codec import pack
from pdserve.core.service_tiers import ServiceTiers
from pdserve.core.settings import KvBlockSettings, default_of
from pdserve.conductor.routing_policies import make_routing_policy
from pdserve.errors import PdserveError
from pdserve.model.config import ModelConfig, model_fingerprint
from pdserve.server.api import BodyLimit, SendTimeout, create_app
from pdserve.server.launch import api_keys, gateway_sampling_defaults
from pdserve.server.gateway import Gateway
from pdserve.server.joins import JoinPolicy
from pdserve.server.metrics import Metrics
from pdserve.server.supervisor import Supervisor
from pdserve.transfer.zmq_auth import secure_server
from pdserve.tokenizer import Tokenizer


class StartupError(PdserveError):
    error_type = "server_error"


async def run_gateway(cfg, procs, model_dir: str, stop: asyncio.Event | None = None, announce=None) -> int:
    """Serve until SIGINT/SIGTERM (or `stop` is set: the gateway in a Ray actor); `announce(line)` says where
    it serves once it does."""
    engine_fields = procs.engine
    ctx = zmq.asyncio.Context()
    events = ctx.socket(zmq.PULL)
    secure_server(events)  # this deployment's workers only (`pdserve.transfer.zmq_auth`)
    if procs.specs:  # the workers started here (ipc); workers that join come through the control port
        events.bind(procs.specs[0].event_addr)
    _bind_control(events, cfg)
    metrics = Metrics(cfg.prices)
    tiers = ServiceTiers.from_specs(engine_fields.get("service_tiers") or ())
    predict = cfg.admission == "predict" or (cfg.admission is None and tiers.any_slo)
    admission = Admission(cfg.admission_margin, cfg.max_outstanding, predict)
    tracer = _tracer(cfg)
    conductor = Conductor(ctx, events, cfg.mode, make_routing_policy(cfg.routing), metrics, tiers, admission,
                          idle_prewarm=cfg.idle_prewarm, max_queue=cfg.max_queue, tracer=tracer)
    conductor.core.roles = _role_planner(cfg)
    for spec in procs.specs:
        conductor.add_worker(spec.name, spec.role, spec.cmd_addr)
    block_size = engine_fields.get("block_size") or default_of(KvBlockSettings, "block_size")
    conductor.join_check = JoinPolicy(cfg.mode, model_fingerprint(model_dir), block_size).check
    procs.start()
    event_task = asyncio.create_task(conductor.run_events())
    try:
        await _wait_ready(conductor, procs, cfg.ready_timeout_s)
        gateway = Gateway(_tokenizer(model_dir), conductor, metrics, served_name(cfg),
                          min(w.info["max_model_len"] for w in conductor.workers.values()))
        gateway.auto_tier, gateway.kv_sensitivity = cfg.api_key_tier, cfg.kv_sensitivity
        gateway.sampling_defaults = gateway_sampling_defaults(cfg, engine_fields, model_dir)
        gateway.cluster = procs if hasattr(procs, "add") else None  # (Ray: workers placed and scaled live)
        app = SendTimeout(BodyLimit(create_app(gateway, api_keys(cfg)), cfg.max_body_bytes), cfg.stream_timeout_s,
                          metrics)
        server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                               lifespan="off",
                                               timeout_graceful_shutdown=cfg.drain_timeout_s))
        supervisor = gateway.supervisor = Supervisor(
            conductor, procs, cfg.restart_workers, cfg.max_restarts, cfg.heartbeat_timeout_s, cfg.ready_timeout_s,
            plan_every_s=conductor.core.roles.interval_s if conductor.core.roles else None)
        monitor = asyncio.create_task(_monitor(supervisor, server, cfg, announce or _say))
        stopper = asyncio.create_task(_stop_when(stop, server)) if stop is not None else None
        await server.serve()
        monitor.cancel()
        if stopper is not None:
            stopper.cancel()
        return 0
    finally:
        for w in conductor.workers.values():
            if w.joined and w.load.alive:  # a worker that joined stops with the deployment it joined
                w.socket.send(pack(Shutdown()))
                w.socket.close(linger=1000)
        event_task.cancel()
        for w in conductor.workers.values():
            w.socket.close(linger=0)
        conductor.refusals.close()
        events.close(linger=0)
        ctx.term()
        if tracer is not None:
            tracer.shutdown()


def _role_planner(cfg):
    """--role-switching auto: the planner, deciding every 10 s (or a third of the hold, if shorter)."""
    if cfg.role_switching != "auto":
        return None
    from pdserve.core.role_planner import RolePlanner
    return RolePlanner(interval_s=max(1.0, min(10.0, cfg.role_switch_hold_s / 3)), hold_s=cfg.role_switch_hold_s,
                       cooldown_s=cfg.role_switch_cooldown_s)


def _tracer(cfg):
    """Request traces to --otlp-endpoint (OpenTelemetry loaded only then)."""
    if cfg.otlp_endpoint is None:
        return None
    from pdserve.server.tracing import RequestTracer
    return RequestTracer(cfg.otlp_endpoint, served_name(cfg))


def _bind_control(events, cfg) -> None:
    """--control-port: the event socket also listens on TCP, for workers that join."""
    if cfg.control_port is None:
        return
    host = cfg.control_host or cfg.host
    try:
        events.bind(f"tcp://{'[' + host + ']' if ':' in host else host}:{cfg.control_port}")
    except zmq.ZMQError as e:
        raise StartupError(f"cannot listen on --control-port {host}:{cfg.control_port}: {e.strerror}") from e


def served_name(cfg) -> str:
    """--served-model-name, else the default model's name, a GGUF file's stem or the directory's name."""
    if cfg.served_model_name:
        return cfg.served_model_name
    if cfg.model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(cfg.model)
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def _tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer.from_dir(model_dir, ModelConfig.from_dir(Path(model_dir)).eos_token_ids)


async def _wait_ready(conductor: Conductor, procs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    joins = getattr(procs, "expected_joins", 0)  # workers placed elsewhere (Ray) that join
    while not conductor.ready or sum(1 for w in conductor.workers.values() if w.joined and w.info) < joins:
        dead = procs.dead()
        if dead:
            raise StartupError(_startup_failure(dead[0], procs.log_tail(dead[0])))
        if time.monotonic() > deadline:
            raise StartupError(f"workers not ready after {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


def _startup_failure(name: str, log_tail: str) -> str:
    """Why worker `name` exited before it was ready: the setting it refused, in one line (its log's last line is
    `error: ...`, `pdserve.worker.worker.run`), else the tail of its log."""
    last = log_tail.rstrip().rpartition("\n")[2]
    if last.startswith("error: "):
        return f"worker {name} could not start: {last.removeprefix('error: ')}"
    return f"worker {name} exited during start-up:\n{log_tail}"


def _say(line: str) -> None:
    print(line, flush=True)


async def _stop_when(stop: asyncio.Event, server: uvicorn.Server) -> None:
    await stop.wait()
    server.should_exit = True  # as SIGTERM does: drain, then stop


async def _monitor(supervisor: Supervisor, server: uvicorn.Server, cfg, announce) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    shape = (f"{cfg.prefill} prefill + {cfg.decode} decode, {cfg.transport}" if cfg.mode == "pd"
             else f"{cfg.instances} colocated")
    joins = (f"; workers join at tcp://{cfg.control_host or cfg.host}:{cfg.control_port}"
             if cfg.control_port is not None else "")
    announce(f"pdserve: serving {served_name(cfg)} ({shape}) at http://{cfg.host}:{cfg.port}{joins}")
    await supervisor.run(stopping=lambda: server.should_exit)
