"""`pdserve serve --cluster ray`: the gateway as the Ray driver, its workers as Ray actors
(`pdserve.cluster.ray_workers`). Ray is imported only here and there, only with --cluster."""

from __future__ import annotations

import os
import socket
from dataclasses import replace

from pdserve.cluster.joined import zmq_address
from pdserve.cluster.ray_workers import NAMESPACE, RayWorkers, parse_cluster
from pdserve.errors import InvalidRequestError
from pdserve.transfer import peer_auth


def ray_config(cfg):
    """Connect to (or start) the Ray cluster; the deployment's control socket on this node's address, a secret
    for the actors, KV over tcp."""
    try:
        import ray
    except ImportError as e:
        raise InvalidRequestError("--cluster ray needs Ray: pip install 'pdserve[ray]'", param="cluster") from e
    os.environ.setdefault(peer_auth.ENV, peer_auth.new_secret())
    ray.init(address=parse_cluster(cfg.cluster), namespace=NAMESPACE, log_to_driver=False,
             include_dashboard=False if parse_cluster(cfg.cluster) is None else None)
    here = ray.util.get_node_ip_address()
    return replace(cfg, transport="tcp", control_host=cfg.control_host or here,
                   control_port=cfg.control_port or _free_port(here), data_host=here)


def ray_workers(cfg, specs) -> RayWorkers:
    """The worker specs as actors to place: each joins this gateway's control socket."""
    event_addr = zmq_address(cfg.control_host, cfg.control_port)
    joined = [replace(s, joined=True, transport="tcp", event_addr=event_addr, drain_timeout_s=cfg.drain_timeout_s,
                      join_timeout_s=cfg.ready_timeout_s) for s in specs]
    return RayWorkers(joined, cfg.model, cfg.max_restarts if cfg.restart_workers else 0,
                      num_cpus=specs[0].engine.get("num_threads") or 1)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
