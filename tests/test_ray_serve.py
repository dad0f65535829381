"""A Ray deployment (issue 17): `pdserve serve --cluster ray://ADDRESS` on a local two-node Ray cluster
(`ray.cluster_utils.Cluster`): the gateway and the workers are Ray actors (the `pdserve serve` process only the
driver), the workers join the gateway; a second prefill worker is added live and takes prompts; a worker whose
process dies is started again by Ray and joins again under its name; a removed worker leaves without losing a
request; a gateway whose process dies is started again by Ray, places its workers again and serves; the
driver's SIGTERM ends every actor."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serve_util import Server

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    c.add_node(num_cpus=2)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def server(cluster):
    s = Server("--cluster", f"ray://{cluster.address}", "--num-threads", "1", "--heartbeat-timeout-s", "60")
    yield s
    s.stop()


def _workers(server: Server) -> dict[str, dict]:
    return {w["name"]: w for w in httpx.get(server.url + "/health", timeout=10).json()["workers"]}


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def _complete(server: Server, n: int, tokens: int = 8) -> list[int]:
    """`n` requests at once (so routing has more than one prompt in flight to place)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def one(i: int) -> int:
        return client.completions.create(model=MODEL, prompt=f"Fact {i}: the ocean", max_tokens=tokens,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


@pytest.fixture(scope="module")
def ray_client(cluster):
    ray.init(address=cluster.address, namespace="pdserve", log_to_driver=False)
    yield ray
    ray.shutdown()


def _actor_names(ray_client) -> list[str]:
    return [a["name"] for a in ray_client.util.list_named_actors(all_namespaces=True) if a["namespace"] == "pdserve"]


def _gateway_pid(ray_client) -> int:
    """The pid the gateway's Ray actor reports (asked through Ray, not through the gateway's HTTP)."""
    [name] = [n for n in _actor_names(ray_client) if n.endswith("-gateway")]
    return ray_client.get(ray_client.get_actor(name, namespace="pdserve").pid.remote(), timeout=30)


def test_the_gateway_and_the_workers_are_ray_actors_on_the_cluster_and_serve(server, ray_client):
    workers = _workers(server)
    assert {n: w["state"] for n, w in workers.items()} == {"prefill-0": "ready", "decode-0": "ready"}
    assert _complete(server, 3) == [8, 8, 8]
    assert server.metric("pdserve_kv_transfer_bytes_total", worker="decode-0") > 0  # over tcp between actors
    assert server.metric("pdserve_workers_joined_total") == 2
    names = _actor_names(ray_client)
    assert sorted(n.rsplit("-", 2)[-2] + "-" + n.rsplit("-", 1)[-1] for n in names if not n.endswith("-gateway")) \
        == ["decode-0", "prefill-0"]
    gateway = httpx.get(server.url + "/health", timeout=10).json()["gateway"]["pid"]
    assert gateway == _gateway_pid(ray_client) and gateway != server.proc.pid  # HTTP served by the actor
    assert "(gateway and workers: Ray actors)" in server.output()


def test_a_prefill_worker_added_live_takes_prompts_and_leaves_when_removed(server):
    r = httpx.post(server.url + "/v1/cluster/workers", json={"role": "prefill"}, timeout=10)
    assert r.status_code == 202 and r.json()["name"] == "prefill-1"
    _wait(lambda: _workers(server).get("prefill-1", {}).get("state") == "ready", 240, "prefill-1 never joined")
    assert _complete(server, 6) == [8] * 6
    links = {dict(lab)["link"]: v for (n, lab), v in server.metrics().items() if n == "pdserve_kv_link_bytes_total"}
    assert links.get("prefill-1->decode-0", 0) > 0, links  # routing sends it prompts
    assert httpx.delete(server.url + "/v1/cluster/workers/prefill-1", timeout=10).status_code == 202
    _wait(lambda: _workers(server)["prefill-1"]["state"] == "left", 120, "prefill-1 never left")
    assert server.metric("pdserve_workers_left_total", how="drained") == 1
    assert _complete(server, 2) == [8, 8]
    bad = httpx.delete(server.url + "/v1/cluster/workers/nobody", timeout=10)
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "worker_not_found"


def test_a_worker_whose_process_dies_is_started_again_by_ray_and_joins_again(server):
    before = _workers(server)["decode-0"]
    os.kill(before["pid"], signal.SIGKILL)
    _wait(lambda: _workers(server)["decode-0"]["pid"] != before["pid"]
          and _workers(server)["decode-0"]["state"] == "ready", 240, "decode-0 was not started again")
    assert _workers(server)["decode-0"]["restarts"] == before["restarts"] + 1
    assert _complete(server, 2) == [8, 8]


def test_a_gateway_whose_process_dies_is_started_again_by_ray_and_serves(server, ray_client):
    before = httpx.get(server.url + "/health", timeout=10).json()
    os.kill(before["gateway"]["pid"], signal.SIGKILL)

    def serving_again() -> bool:
        try:
            now = httpx.get(server.url + "/health", timeout=5)
        except httpx.HTTPError:
            return False
        return now.status_code == 200 and now.json()["gateway"]["pid"] != before["gateway"]["pid"]

    _wait(serving_again, 300, "the gateway was not started again")
    assert server.proc.poll() is None  # the driver waited through it
    after = _workers(server)
    assert {n: w["state"] for n, w in after.items()} == {"prefill-0": "ready", "decode-0": "ready"}
    old = {w["name"]: w["pid"] for w in before["workers"] if w["state"] == "ready"}
    assert all(after[n]["pid"] != pid for n, pid in old.items() if n in after)  # its workers were placed anew
    assert _complete(server, 2) == [8, 8]
    assert httpx.get(server.url + "/health", timeout=10).json()["gateway"]["pid"] == _gateway_pid(ray_client)


def test_sigterm_to_the_driver_stops_the_gateway_and_ends_every_actor(server, ray_client):
    assert server.stop(signal.SIGTERM, timeout_s=120) == 0
    _wait(lambda: not _actor_names(ray_client), 60, f"actors left behind: {_actor_names(ray_client)}")
