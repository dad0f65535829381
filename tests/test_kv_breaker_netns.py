"""A blackholed KV peer (issue 40 item 4), with real processes: the gateway, its prefill worker and a local
decode worker in this network namespace, a second decode worker (`decode-ns`) joining from another over a veth
pair (tcp transport). The decode worker's KV port is blackholed: its replies dropped inside its namespace (an
`ip rule` by source port to a blackhole route: this kernel has no iptables, nft or tc drop actions), so the
prefill worker's connects and sends to it get no answer at all, while the control plane, on other ports, still
crosses. Shown:

* the prefill worker's breaker to `decode-ns` opens (`pdserve_kv_path_state` 2, a transition to open counted),
  its steps are not stalled: a request to the local decode worker completes promptly meanwhile, and every
  answer stays the in-process engine's;
* while open the conductor pairs the prefill worker with the local decode worker (counted reroutes), and the
  failed prompt sent again is a prefix-cache hit on the prefill worker (its KV kept for a grace period);
* once the port answers again, a probe goes through and the path closes (`pdserve_kv_path_state` 0).

Needs root and `ip`; skipped with the reason where a namespace cannot be made (`pdserve.bench.netns`)."""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import openai
import pytest

from pdserve.bench.netns import Netns, NetnsUnavailable
from pdserve.bench.netns import netns as make_netns
from serve_util import across_netns, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SECRET = {"PDSERVE_DEPLOYMENT_SECRET": secrets.token_hex(32)}
KV_TIMEOUT_S = 15.0
BOUND_S = 3.0  # a connect or send waits this long at most: --kv-send-timeout-s (below a third of the lease)
TOKENS = 8
PROMPTS = [f"Note {i}: the blackholed peer's prompt asks for a list of the planets of the solar system, in order "
           f"from the sun, and number {i} of them is" for i in range(80)]
STATE = "pdserve_kv_path_state"


@pytest.fixture(scope="module")
def split():
    with ExitStack() as stack:
        try:
            ns = stack.enter_context(make_netns())
        except NetnsUnavailable as e:
            pytest.skip(f"cannot make a network namespace here: {e}")
        server = stack.enter_context(across_netns(ns, "--decode", "1", "--kv-timeout-s", str(KV_TIMEOUT_S),
                                                  "--kv-send-timeout-s", str(BOUND_S),
                                                  env=SECRET))
        yield server, ns, _kv_port(ns)


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    from pdserve import LLM, SamplingParams
    llm = LLM(num_threads=1)
    return {p: o.text for p, o in zip(PROMPTS, llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS,
                                                                                      temperature=0)))}


def _kv_port(ns: Netns) -> int:
    """The joined decode worker's KV port: the one it listens on that nothing is connected to before any
    request (its command socket has the gateway's connection)."""
    ports = wait_for(lambda: ns.ports(listening=True) - ns.ports(listening=False), lambda p: len(p) == 1,
                     timeout_s=30)
    assert len(ports) == 1, ports
    return ports.pop()


def _ask(client: openai.OpenAI, prompt: str) -> tuple[str, str, float]:
    start = time.monotonic()
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0)
    return prompt, out.choices[0].text, time.monotonic() - start


def _state(server) -> float | None:
    """The prefill worker's breaker to decode-ns (None: no series yet)."""
    got = [v for (n, lab), v in server.metrics().items() if n == STATE and dict(lab).get("peer") == "decode-ns"]
    return got[0] if got else None


def _transitions(server, to: str) -> float:
    return server.metric("pdserve_kv_path_transitions_total", peer="decode-ns", to=to)


def test_a_blackholed_peer_opens_its_breaker_without_stalling_and_closes_after(split, reference):
    server, ns, port = split
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = iter(PROMPTS)
    answers: list[tuple[str, str, float]] = []
    with ThreadPoolExecutor(2) as pool:
        def pair() -> list[tuple[str, str, float]]:  # two at once: both decode workers get one
            two = [p for p in (next(prompts, None), next(prompts, None)) if p is not None]
            got = list(pool.map(lambda p: _ask(client, p), two))
            answers.extend(got)
            return got

        # both decode workers served: the path to decode-ns is known, closed
        assert wait_for(lambda: pair() and _state(server), lambda v: v is not None, timeout_s=60) == 0
        with ns.blackholed(port):
            lost: list[str] = []
            pairs = []
            while _transitions(server, "open") < 1 and len(pairs) < 8:
                pairs.append(pair())
                lost.extend(p for p, _, _ in pairs[-1])
            assert _transitions(server, "open") >= 1 and server.wait_metric(STATE, lambda v: v > 0, peer="decode-ns")
            # the prefill worker's steps went on: in each pair, the request not bound for decode-ns was prompt,
            # done before the held send to decode-ns could have failed
            # (a request alone takes ~1 s here; one whose prefill waited for a held send would take longer)
            assert max(min(s for _, _, s in got) for got in pairs) < BOUND_S, pairs
            # while open: routed around (counted), and the prompts sent meanwhile hit the prefill worker's cache
            hits = server.metric("pdserve_prefix_cache_hit_tokens_total", worker="prefill-0")
            again = []
            for p in reversed(lost):  # the ones decode-ns was sent hold their prefix there: routing picks it for
                again.append(_ask(client, p))  # them, and the open path turns it away (which of them: timing's)
                if server.metric("pdserve_fallbacks_total", kind="kv_path_open_rerouted") > 0 or len(again) == 4:
                    break
            answers.extend(again)
            assert max(s for _, _, s in again) < KV_TIMEOUT_S, again
            assert server.wait_metric("pdserve_fallbacks_total", lambda v: v > 0, kind="kv_path_open_rerouted")
            assert server.wait_metric("pdserve_prefix_cache_hit_tokens_total", lambda v: v > hits, worker="prefill-0")
        # the port answers again: a probe goes through and the path closes
        def closing() -> tuple[float | None, float]:
            pair()  # (the path's probe, once due)
            return _state(server), _transitions(server, "closed")
        closed = wait_for(closing, lambda v: v[0] == 0 and v[1] >= 1, timeout_s=90)
        assert closed[0] == 0 and closed[1] >= 1 and _transitions(server, "half_open") >= 1, closed
    assert [(p, text) for p, text, _ in answers] == [(p, reference[p]) for p, _, _ in answers]
