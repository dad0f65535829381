"""`pdserve serve --cluster ray[://ADDRESS]`: the whole deployment as Ray actors.

The `pdserve serve` process is only the Ray driver: it connects to the cluster (RAY_ADDRESS, else a new local
one; or the cluster whose GCS is at ADDRESS) and places the gateway as a Ray actor (`GatewayActor`) on its own
node, the one whose --host/--port clients reach; the gateway places the workers as actors
(`pdserve.worker.ray_workers`). Ray owns them as it owns everything: the workers by the gateway, the gateway by
the driver. When the driver ends, the deployment ends with it; when the gateway's process dies, Ray starts it
again on the same node (up to --max-restarts; none with --no-restart-workers) and the new gateway places a
new set of workers (the old ones end with the gateway that owned them; requests in flight on the dead gateway
end with their connections). SIGINT/SIGTERM to the driver stops the gateway as they stop a local one (drain,
then the workers), then the driver leaves the cluster. Ray is imported only here and in `ray_workers`, and
only with --cluster.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import uuid
from dataclasses import replace

from pdserve.worker.joined import zmq_address
from pdserve.worker.ray_workers import NAMESPACE, RayWorkers, parse_cluster
from pdserve.errors import InvalidRequestError, PdserveError
from pdserve.transfer import peer_auth

POLL_S = 0.5


class GatewayLost(PdserveError):
    error_type = "server_error"


class GatewayActor:
    """The gateway (conductor, supervisor, HTTP server) in a Ray actor: `serve` runs it until `stop`."""

    def __init__(self, cfg, engine: dict, model_dir: str) -> None:
        self.cfg, self.engine, self.model_dir = cfg, engine, model_dir
        self.stopping = asyncio.Event()
        self.started = asyncio.Event()
        self.line = ""

    async def serve(self) -> int:
        from pdserve.server.app_runtime import StartupError, run_gateway
        from pdserve.server.launch import worker_specs
        cfg = gateway_config(self.cfg)
        run_dir = tempfile.mkdtemp(prefix="pdserve-")
        procs = ray_workers(cfg, worker_specs(cfg, self.model_dir, self.engine, run_dir))
        try:
            return await run_gateway(cfg, procs, self.model_dir, stop=self.stopping, announce=self._announce)
        except StartupError as e:  # (workers not ready in time: those Ray could not place, and why)
            raise StartupError(e.message + procs.placements.waiting()) from None
        finally:
            procs.stop()
            shutil.rmtree(run_dir, ignore_errors=True)

    async def banner(self) -> str:
        """Once it serves: the line that says where."""
        await self.started.wait()
        return self.line

    async def stop(self) -> None:
        self.stopping.set()

    async def pid(self) -> int:
        return os.getpid()

    def _announce(self, line: str) -> None:
        print(line, flush=True)
        self.line = line
        self.started.set()


def serve_on_ray(cfg, engine: dict, model_dir: str) -> int:
    """The driver: connect, place the gateway, print where it serves, wait; on SIGINT/SIGTERM stop it."""
    from pdserve.server.launch import sigterm_as_interrupt
    try:
        import ray
    except ImportError as e:
        raise InvalidRequestError("--cluster ray needs Ray: pip install 'pdserve[ray]'", param="cluster") from e
    os.environ.setdefault(peer_auth.ENV, peer_auth.new_secret())
    address = parse_cluster(cfg.cluster)
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
             include_dashboard=False if address is None else None)
    sigterm_as_interrupt()  # (after ray.init, which sets a SIGTERM handler of its own)
    try:
        gateway = place_gateway(ray, cfg, engine, model_dir)
        return _wait(ray, gateway, cfg)
    finally:
        ray.shutdown()


def place_gateway(ray, cfg, engine: dict, model_dir: str):
    """The gateway actor, pinned to this node (its HTTP address), asking for no CPU of the workers' (it is
    mostly I/O, as Ray Serve's proxies are), restarted by Ray as the workers are."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    restarts = cfg.max_restarts if cfg.restart_workers else 0
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(GatewayActor).options(
        name=f"pdserve-{uuid.uuid4().hex[:8]}-gateway", namespace=NAMESPACE, num_cpus=0, max_restarts=restarts,
        max_task_retries=restarts, scheduling_strategy=here,
        runtime_env={"env_vars": {peer_auth.ENV: os.environ[peer_auth.ENV]}},
    ).remote(cfg, engine, model_dir)


def _wait(ray, gateway, cfg) -> int:
    served, said = gateway.serve.remote(), gateway.banner.remote()
    try:
        while not ray.wait([served], timeout=POLL_S)[0]:
            if said is not None and ray.wait([said], timeout=0)[0]:
                print(ray.get(said), "(gateway and workers: Ray actors)", flush=True)
                said = None
        return _result(ray, served)
    except KeyboardInterrupt:
        try:
            ray.get(gateway.stop.remote(), timeout=30)
            ready = ray.wait([served], timeout=cfg.drain_timeout_s + 30)[0]
        except ray.exceptions.RayError:  # the gateway died meanwhile: nothing left to drain
            ready = []
        ray.kill(gateway, no_restart=True)
        return _result(ray, served) if ready else 1


def _result(ray, served) -> int:
    """The gateway's exit status; its own error (a worker that never became ready) as ours, one line."""
    try:
        return ray.get(served)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, PdserveError):
            raise e.cause from None
        raise GatewayLost(f"the gateway failed: {e.cause!r} (its traceback is in the Ray logs of the gateway "
                          f"actor)") from None
    except ray.exceptions.RayActorError as e:
        raise GatewayLost(f"the gateway's Ray actor died and was not started again: {e}") from None


def gateway_config(cfg):
    """In the actor: the deployment's control socket on this node's address, KV over tcp."""
    import ray
    here = ray.util.get_node_ip_address()
    return replace(cfg, transport="tcp", control_host=cfg.control_host or here,
                   control_port=cfg.control_port or _free_port(here), data_host=here)


def ray_workers(cfg, specs) -> RayWorkers:
    """The worker specs as actors to place: each joins this gateway's control socket."""
    event_addr = zmq_address(cfg.control_host, cfg.control_port)
    joined = [replace(s, joined=True, transport="tcp", event_addr=event_addr, drain_timeout_s=cfg.drain_timeout_s,
                      join_timeout_s=cfg.ready_timeout_s) for s in specs]
    return RayWorkers(joined, cfg.model, cfg.max_restarts if cfg.restart_workers else 0,
                      num_cpus=specs[0].engine.get("num_threads") or 1, ready_timeout_s=cfg.ready_timeout_s)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
