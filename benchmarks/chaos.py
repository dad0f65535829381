"""Chaos rounds against a real `pdserve serve` (issue 15): under N concurrent greedy streams, one fault per
round; each round reports requests lost (ended with an error or incomplete), wrong outputs (text differs
from the undisturbed reference), errors by code, KV blocks still held once the round is over (leaked), and
the recovery time (fault -> /health ok with every worker ready again).

Rounds: kill -9 a decode worker; kill -9 a prefill worker; SIGSTOP a decode worker past the heartbeat timeout;
1% of KV chunks corrupted (its own server, `PDSERVE_FAULT_CORRUPT_CHUNKS=100`); clients disconnecting
mid-stream (`--disconnects` of them, then the reference streams again); a burst of 10x the streams. With the
tcp path's protection on (issue 40: `--transport tcp --kv-sensitivity secret`, every connection taken as
crossing hosts, `PDSERVE_KV_CROSS_HOST=always`, test-only), each on its own 1 + 1 server: 1% of sealed records
tampered after sealing (`PDSERVE_FAULT_CORRUPT_CHUNKS=100`) and 1% of records replayed on the connection
(`PDSERVE_FAULT_REPLAY_RECORDS=100`); each refused record is counted (`pdserve_kv_auth_failures_total`) and its
prompt recomputed. A blackholed peer (needs root and iproute2: two network namespaces): a decode worker joins from
a second namespace over a veth beside a local one (tcp, secret KV), and its KV port drops every packet for
`--blackhole-s` seconds while the streams run (`Netns.blackholed`); its breaker must open, the conductor route around
it, and the path close again after (`pdserve_kv_path_state`).

    .venv/bin/python benchmarks/chaos.py [--streams 32] [--tokens 48] [--disconnects 1000] [--only-wire-faults]
        [--only-blackhole] [--blackhole-s 20] [--out bench_results/chaos.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from serve_proc import Server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
HEARTBEAT_S = 10.0


def prompts(n: int) -> list[str]:
    return [f"Story {i}: in a town by the river there lived a" for i in range(n)]


async def stream(client: httpx.AsyncClient, url: str, prompt: str, tokens: int, started=None) -> tuple[str, str | None]:
    """(text, error code or None)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, chunks = "", 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return text, json.loads(await r.aread())["error"]["code"] or str(r.status_code)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return text, data["error"].get("code") or "error"
                text += data["choices"][0]["text"]
                chunks += 1
                if started is not None and chunks == 4:
                    started.set()
    except httpx.HTTPError as e:
        return text, type(e).__name__
    return text, None


async def run_streams(url: str, ps: list[str], tokens: int, fault=None) -> list[tuple[str, str | None]]:
    """All `ps` at once; `fault()` is called once every stream has its first tokens."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2000)) as client:
        started = [asyncio.Event() for _ in ps]
        tasks = [asyncio.create_task(stream(client, url, p, tokens, e)) for p, e in zip(ps, started)]
        if fault is not None:
            done = asyncio.gather(*(e.wait() for e in started))
            try:
                await asyncio.wait_for(done, 300)
            finally:
                fault()
        return await asyncio.gather(*tasks)


def worker_pid(server: Server, name: str) -> int:
    for child in psutil.Process(server.proc.pid).children():
        if f'{{"name": "{name}"'.encode() in " ".join(child.cmdline()).encode():
            return child.pid
    raise LookupError(name)


def wait_recovered(server: Server, since: float, timeout_s: float = 180) -> float | None:
    """Seconds from `since` until /health is ok with every worker ready (None: not within the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            h = httpx.get(server.url + "/health", timeout=5).json()
            if h["status"] == "ok" and all(w["state"] == "ready" for w in h["workers"]):
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return None


def leaked_blocks(server: Server, settle_s: float = 20.0) -> float:
    """KV blocks live requests hold once nothing runs: polled until 0 or `settle_s` (aborts and lent blocks
    are released within a few worker loops; the workers report every 0.25 s)."""
    deadline = time.monotonic() + settle_s
    while True:
        time.sleep(0.5)
        used = sum(v for (n, _), v in server.metrics().items() if n == "pdserve_kv_blocks_used")
        if used == 0 or time.monotonic() > deadline:
            return used


def judge(results, reference: list[str]) -> dict:
    errors = Counter(code for _, code in results if code is not None)
    lost = sum(1 for text, code in results if code is not None)
    wrong = sum(1 for (text, code), ref in zip(results, reference) if code is None and text != ref)
    return {"requests": len(results), "lost": lost, "wrong": wrong, "errors": dict(errors)}


def fault_round(server: Server, name: str, sig, ps, ref, tokens) -> dict:
    pid, when = worker_pid(server, name), {}

    def fault():
        os.kill(pid, sig)
        when["t"] = time.monotonic()

    out = judge(asyncio.run(run_streams(server.url, ps, tokens, fault)), ref)
    out["recovery_s"] = wait_recovered(server, when["t"])
    out["leaked_blocks"] = leaked_blocks(server)
    return out


def disconnect_round(server: Server, n: int, tokens: int) -> dict:
    async def one(client, i):
        body = {"model": MODEL, "prompt": f"Client {i} asks:", "max_tokens": tokens, "stream": True,
                "ignore_eos": True}
        try:
            async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    break  # gone after the first bytes
        except httpx.HTTPError:
            pass

    async def all_of_them():
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
            await asyncio.gather(*(one(client, i) for i in range(n)))

    start = time.monotonic()
    asyncio.run(all_of_them())
    return {"clients": n, "seconds": time.monotonic() - start, "leaked_blocks": leaked_blocks(server)}


def env_fault_round(name: str, args: list[str], env: dict, ps, ref, tokens: int, out_dir: Path) -> dict:
    """The reference streams on a 1 + 1 server started with `args` and the fault `env` in its environment."""
    os.environ.update(env)
    try:
        server = Server(["--prefill", "1", "--decode", "1", *args], out_dir / f"chaos_{name.split()[0]}.log")
    finally:
        for key in env:
            del os.environ[key]
    try:
        server.warm_up()
        got = judge(asyncio.run(run_streams(server.url, ps, tokens)), ref)
        m = server.metrics()
        failures = Counter()
        for (n, lab), v in m.items():
            if n == "pdserve_kv_transfer_failures_total":
                failures[dict(lab).get("reason")] += v
        got["transfer_failures"] = dict(failures)
        got["auth_failures"] = sum(v for (n, _), v in m.items() if n == "pdserve_kv_auth_failures_total")
        got["recomputed_tokens"] = sum(v for (n, _), v in m.items() if n == "pdserve_kv_recomputed_tokens_total")
        got["leaked_blocks"] = leaked_blocks(server)
        return got
    finally:
        server.stop()


def process_rounds(report: dict, ps: list[str], args, out_dir: Path) -> list[str]:
    """The rounds on one 2 + 2 server (workers killed or stopped, disconnects, a burst); the reference texts."""
    server = Server(["--prefill", "2", "--decode", "2", "--heartbeat-timeout-s", str(HEARTBEAT_S)],
                    out_dir / "chaos_server.log")
    try:
        server.warm_up()
        ref = [t for t, _ in asyncio.run(run_streams(server.url, ps, args.tokens))]
        rounds = report["rounds"]
        rounds["kill -9 decode"] = fault_round(server, "decode-0", signal.SIGKILL, ps, ref, args.tokens)
        rounds["kill -9 prefill"] = fault_round(server, "prefill-0", signal.SIGKILL, ps, ref, args.tokens)
        rounds["SIGSTOP decode"] = fault_round(server, "decode-1", signal.SIGSTOP, ps, ref, args.tokens)
        rounds["disconnects"] = disconnect_round(server, args.disconnects, args.tokens)
        again = judge(asyncio.run(run_streams(server.url, ps, args.tokens)), ref)
        rounds["disconnects"].update(after=again)
        burst = ps * 10
        start = time.monotonic()
        rounds["10x burst"] = judge(asyncio.run(run_streams(server.url, burst, args.tokens)), ref * 10)
        rounds["10x burst"].update(seconds=time.monotonic() - start, leaked_blocks=leaked_blocks(server))
    finally:
        server.stop()
    return ref


def reference(ps: list[str], tokens: int, out_dir: Path) -> list[str]:
    """The texts of an undisturbed 1 + 1 server."""
    server = Server(["--prefill", "1", "--decode", "1"], out_dir / "chaos_server.log")
    try:
        server.warm_up()
        return [t for t, _ in asyncio.run(run_streams(server.url, ps, tokens))]
    finally:
        server.stop()


SEALED = ["--transport", "tcp", "--kv-sensitivity", "secret"]
WIRE_FAULTS = (("corrupt 1% of chunks", [], {"PDSERVE_FAULT_CORRUPT_CHUNKS": "100"}),
               ("tamper 1% of sealed records (AEAD)", SEALED,
                {"PDSERVE_FAULT_CORRUPT_CHUNKS": "100", "PDSERVE_KV_CROSS_HOST": "always"}),
               ("replay 1% of records (AEAD)", SEALED,
                {"PDSERVE_FAULT_REPLAY_RECORDS": "100", "PDSERVE_KV_CROSS_HOST": "always"}))


def _path_metrics(server: Server) -> dict:
    """The blackhole round's counters: the path's breaker, reroutes, failed sends, recomputed tokens."""
    m = server.metrics()

    def total(name: str, **labels) -> float:
        return sum(v for (n, lab), v in m.items() if n == name and labels.items() <= dict(lab).items())
    return {"opened": total("pdserve_kv_path_transitions_total", peer="decode-ns", to="open"),
            "closed": total("pdserve_kv_path_transitions_total", peer="decode-ns", to="closed"),
            "state": total("pdserve_kv_path_state", peer="decode-ns"),
            "rerouted": total("pdserve_fallbacks_total", kind="kv_path_open_rerouted"),
            "send_failures": total("pdserve_kv_send_failures_total"),
            "recomputed_tokens": total("pdserve_kv_recomputed_tokens_total")}


def blackhole_round(ps, ref, tokens: int, hole_s: float, out_dir: Path) -> dict:
    """The reference streams with the KV port of a decode worker joined from another namespace blackholed for
    `hole_s` seconds from their start; then streams again until its path's breaker has closed."""
    import secrets
    import threading
    from pdserve.bench.netns import NetnsUnavailable, netns, reap
    from pdserve.bench.server_proc import free_port
    env = {"PDSERVE_DEPLOYMENT_SECRET": secrets.token_hex(32)}
    try:
        ns_context = netns()
        ns = ns_context.__enter__()
    except NetnsUnavailable as e:
        return {"skipped": str(e)}
    try:
        control = free_port()
        with open(out_dir / "chaos_decode_ns.log", "w") as log:
            worker = ns.join_worker(f"tcp://{ns.host_ip}:{control}", "decode-ns", env=env, log=log)
        os.environ.update(env)
        server = Server(["--transport", "tcp", "--kv-sensitivity", "secret", "--decode", "1", "--control-port",
                         str(control), "--control-host", ns.host_ip, "--data-host", ns.host_ip,
                         "--kv-send-timeout-s", "3", "--kv-breaker-cool-s", "2"], out_dir / "chaos_blackhole.log")
        try:
            server.warm_up()
            port = _wait(lambda: ns.ports(listening=True) - ns.ports(listening=False), lambda p: len(p) == 1)
            hole = ns.blackholed(port.pop())
            hole.__enter__()
            threading.Timer(hole_s, hole.__exit__, (None, None, None)).start()
            start = time.monotonic()
            got = judge(asyncio.run(run_streams(server.url, ps, tokens)), ref)
            got.update(seconds=time.monotonic() - start, blackhole_s=hole_s, during=_path_metrics(server))
            time.sleep(max(hole_s - (time.monotonic() - start), 0) + 0.5)
            again = []  # the port answers again: streams until a probe has closed the path
            while _path_metrics(server)["state"] != 0 and time.monotonic() - start < hole_s + 120:
                again.append(judge(asyncio.run(run_streams(server.url, ps[:4], tokens)), ref[:4]))
            got.update(after={"lost": sum(a["lost"] for a in again), "wrong": sum(a["wrong"] for a in again),
                              "requests": sum(a["requests"] for a in again), **_path_metrics(server)},
                       closed_after_s=time.monotonic() - start, leaked_blocks=leaked_blocks(server))
            return got
        finally:
            server.stop()
            reap(worker)
    finally:
        for key in env:
            os.environ.pop(key, None)
        ns_context.__exit__(None, None, None)


def _wait(probe, ok, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not ok(got := probe()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--disconnects", type=int, default=1000)
    ap.add_argument("--out", default="bench_results/chaos.json")
    ap.add_argument("--only-wire-faults", action="store_true",
                    help="only the rounds of faults on the KV path (corrupt, tamper, replay), each on its own 1 + 1 "
                         "server; the reference from an undisturbed 1 + 1 server")
    ap.add_argument("--only-blackhole", action="store_true", help="only the blackhole round (and the reference)")
    ap.add_argument("--blackhole-s", type=float, default=20.0,
                    help="how long the blackhole round drops the joined decode worker's KV packets (0: no such round)")
    args = ap.parse_args()
    out_dir = Path(args.out).parent
    ps = prompts(args.streams)
    report = {"cpu": platform.processor() or subprocess.run(["lscpu"], capture_output=True, text=True).stdout
              .split("Model name:")[1].splitlines()[0].strip(), "streams": args.streams, "tokens": args.tokens,
              "rounds": {}}
    if args.only_wire_faults or args.only_blackhole:
        ref = reference(ps, args.tokens, out_dir)
    else:
        ref = process_rounds(report, ps, args, out_dir)
    for name, extra, env in () if args.only_blackhole else WIRE_FAULTS:
        report["rounds"][name] = env_fault_round(name, extra, env, ps, ref, args.tokens, out_dir)
    if args.blackhole_s > 0:
        report["rounds"]["blackhole a decode worker's KV port"] = blackhole_round(ps, ref, args.tokens,
                                                                                args.blackhole_s, out_dir)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
