"""`pdserve serve`: check the port and the API keys file, resolve the model once, then serve until SIGINT or
SIGTERM with the workers as local processes (`pdserve.server.launch`) or, with --cluster ray, as Ray actors
(`pdserve.server.launch_ray`). The top of the launchers: they and the gateway's loop (`app_runtime`) never
import it."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from pathlib import Path

from pdserve.errors import InvalidRequestError
from pdserve.server.launch import (ServeConfig, WorkerProcesses, api_keys, gateway_sampling_defaults,
                                   sigterm_as_interrupt, worker_specs)


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise InvalidRequestError(f"cannot listen on {host}:{port}: {e.strerror}", param="port") from e


def serve(cfg: ServeConfig, engine: dict) -> int:
    from pdserve.model.loader import resolve_model_dir

    check_port_free(cfg.host, cfg.port)
    api_keys(cfg)  # a bad keys file fails now, before any worker starts
    model_dir = resolve_model_dir(cfg.model, convert_in_child=True)  # a GGUF once, before any worker starts
    print(gateway_sampling_defaults(cfg, engine, model_dir).line(), flush=True)  # (a bad --generation-config: now)
    if cfg.cluster is not None:  # the gateway and its workers as Ray actors
        from pdserve.server.launch_ray import serve_on_ray
        return serve_on_ray(cfg, engine, str(model_dir))
    run_dir = tempfile.mkdtemp(prefix="pdserve-")
    sigterm_as_interrupt()
    master = None
    try:
        engine, master = local_pool(engine, run_dir, cfg.kv_remote_pool_gb)
        return asyncio.run(_serve(cfg, engine, str(model_dir), run_dir))
    except KeyboardInterrupt:
        return 0
    finally:
        if master is not None:
            master.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def local_pool(engine: dict, run_dir: str, pool_gb: float):
    """`--kv-remote local`: a Mooncake master (and metadata server) of the deployment's own and a store server
    holding `pool_gb` GiB, on loopback, started before the workers and stopped after them: (the engine fields with
    its address, the master). Else as given."""
    from pdserve.kv.remote_store import LOCAL
    if engine.get("kv_remote") != LOCAL:
        return engine, None
    from pdserve.mooncake import start_master, unavailable
    why = unavailable()
    if why is not None:
        raise InvalidRequestError(f"--kv-remote local: {why}", param="kv_remote")
    master = start_master(log=Path(run_dir) / "mooncake_master.log", pool_bytes=int(pool_gb * (1 << 30)))
    return dict(engine, kv_remote=master.url), master


async def _serve(cfg: ServeConfig, engine: dict, model_dir: str, run_dir: str) -> int:
    from pdserve.server.app_runtime import run_gateway

    procs = WorkerProcesses(worker_specs(cfg, model_dir, engine, run_dir), run_dir)
    try:
        return await run_gateway(cfg, procs, model_dir)
    finally:
        procs.stop()
