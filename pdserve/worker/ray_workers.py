"""`pdserve serve --cluster ray[://ADDRESS]`: the workers placed on a Ray cluster as Ray actors.

The gateway (itself a Ray actor on the node whose HTTP port clients reach, `pdserve.server.launch_ray`)
places one actor per worker (`WorkerActor`), spread over the cluster's nodes, each asking for its torch threads
as CPUs and, when the cluster has GPUs, one GPU. An actor resolves the model on its own node, binds its sockets
on its node's address, and joins the gateway as `pdserve worker --join` does (`pdserve.worker.joined`): the
gateway's control socket on its node's address, the deployment secret handed to the actors in their Ray
runtime environment, KV between nodes over tcp. The gateway finds its workers through Ray (named actors in
the namespace `pdserve`, one name prefix per deployment); Ray restarts an actor whose process died (up to
`--max-restarts`), and the new process joins again under its name, replacing the dead one at once (its requests
move as a dead worker's); `add`/`remove` grow and shrink the P/D split live (`POST/DELETE
/v1/cluster/workers`): a removed worker leaves as a joined worker does on SIGTERM (nothing lost), then its
actor is ended. Until it joins, a worker's placement is followed through Ray (`pdserve.worker.ray_placement`): one
no node could hold is refused, one Ray cannot place yet is pending, and given up after the ready timeout.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import replace

from pdserve.worker.joined import zmq_address
from pdserve.worker.ray_placement import Placing, Placements
from pdserve.worker.spec import WorkerSpec
from pdserve.errors import InvalidRequestError, NotFoundError
from pdserve.transfer import peer_auth

NAMESPACE = "pdserve"


class WorkerActor:
    """One worker in a Ray actor: built in the constructor (so a restarted actor joins again), its loop in a
    thread of the actor's process; `leave` starts its departure."""

    def __init__(self, spec_json: str, model: str | None) -> None:
        import ray

        from pdserve.worker.worker import Worker
        from pdserve.model.loader import resolve_model_dir
        here = ray.util.get_node_ip_address()
        spec = WorkerSpec.from_json(spec_json)
        spec = replace(spec, model_dir=str(resolve_model_dir(model)), cmd_addr=zmq_address(here, "*"),
                       kv_host=here)
        self.worker = Worker(spec)
        # restarted by Ray: its dead self may still be registered, and is replaced at once
        self.worker.replaces = ray.get_runtime_context().was_current_actor_reconstructed
        threading.Thread(target=self._serve, name="pdserve-worker", daemon=True).start()

    def _serve(self) -> None:
        from pdserve.worker.worker import serve_until_done
        if serve_until_done(self.worker) not in (0, 2):
            os._exit(1)  # crashed: Ray starts the actor again, and it joins again

    def leave(self) -> None:
        if self.worker.departure is not None:
            self.worker.departure.ask()

    def pid(self) -> int:
        return os.getpid()


def parse_cluster(value: str) -> str | None:
    """--cluster ray -> None (RAY_ADDRESS, else a new local Ray cluster); ray://HOST:PORT -> its GCS address."""
    if value == "ray":
        return None
    if value.startswith("ray://") and ":" in value[len("ray://"):]:
        return value[len("ray://"):]
    raise InvalidRequestError(f"--cluster must be ray or ray://HOST:PORT (a Ray cluster's GCS address), got "
                              f"{value!r}", param="cluster")


class RayWorkers:
    """What `WorkerProcesses` is for local workers, on a Ray cluster: the gateway starts, scales and stops its
    workers here; the supervisor watches them as joined workers (heartbeats)."""

    def __init__(self, specs: list[WorkerSpec], model: str | None, max_restarts: int, num_cpus: int,
                 ready_timeout_s: float = 600.0) -> None:
        import ray
        self.ray = ray
        self.specs: list = []  # no worker process of the gateway's own: every one joins
        self.procs: dict = {}
        self.templates = {s.role: s for s in specs}
        self.initial = specs
        self.model = model
        self.max_restarts = max_restarts
        self.num_cpus = num_cpus
        self.prefix = f"pdserve-{uuid.uuid4().hex[:8]}-"
        self.actors: dict[str, object] = {}
        self.counts: dict[str, int] = {}
        self.gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        self._actor_class = ray.remote(WorkerActor)
        self.placements = Placements(ray, {"CPU": num_cpus, "GPU": self.gpus}, ready_timeout_s)

    @property
    def engine(self) -> dict:
        return self.initial[0].engine

    @property
    def expected_joins(self) -> int:
        return len(self.initial)

    def start(self) -> None:
        for spec in self.initial:
            self._place(spec)

    def add(self, role: str) -> str:
        """A new worker of `role` (it joins once its model is loaded) -> its name."""
        if role not in self.templates:
            raise InvalidRequestError(f"this deployment has no {role} workers to add to; roles: "
                                      f"{', '.join(self.templates)}", param="role")
        return self._place(replace(self.templates[role], name=""))

    def replace(self, old: str, role: str) -> None:
        """A worker of `role` in place of `old` (which switched roles and left): placed, it joins by itself."""
        self.add(role)

    def remove(self, name: str) -> None:
        """Worker `name` leaves (drains first); its actor ends once it has left (`left`)."""
        actor = self.actors.get(name)
        if actor is None:
            raise NotFoundError(f"no worker {name!r} placed by this deployment", param="name",
                                code="worker_not_found")
        actor.leave.remote()

    def left(self, name: str) -> None:
        """Worker `name` left the deployment: end its actor (no restart)."""
        actor = self.actors.pop(name, None)
        if actor is not None:
            self.ray.kill(actor, no_restart=True)

    def lost(self, name: str) -> None:
        """Worker `name` went silent (hung): its actor is killed, and Ray starts it again."""
        actor = self.actors.get(name)
        if actor is not None:
            self.ray.kill(actor, no_restart=False)

    def give_up(self) -> list[Placing]:
        """The workers Ray could not place within the ready timeout: their actors ended (no restart)."""
        late = self.placements.overdue()
        for p in late:
            self.left(p.name)
        return late

    def dead(self) -> list[str]:
        return []

    def log_tail(self, name: str, lines: int = 15) -> str:
        return f"(worker {name} runs in a Ray actor: see the Ray logs of actor {self.prefix}{name})"

    def stop(self, grace_s: float = 5.0) -> None:
        for actor in self.actors.values():
            self.ray.kill(actor, no_restart=True)
        self.actors.clear()

    def _place(self, spec: WorkerSpec) -> str:
        self.placements.check_feasible(spec.role)
        if not spec.name:  # added live: the next number of its role
            spec = replace(spec, name=f"{spec.role}-{self.counts.get(spec.role, 0)}")
        self.counts[spec.role] = self.counts.get(spec.role, 0) + 1
        actor = self._actor_class.options(
            name=self.prefix + spec.name, namespace=NAMESPACE, num_cpus=self.num_cpus, num_gpus=self.gpus,
            max_restarts=self.max_restarts, scheduling_strategy="SPREAD",
            runtime_env={"env_vars": {peer_auth.ENV: os.environ[peer_auth.ENV]}},
        ).remote(spec.to_json(), self.model)
        self.actors[spec.name] = actor
        self.placements.add(spec.name, spec.role, actor)
        return spec.name
