"""KV changed, replayed and read on the wire between real workers (issue 40 item 2): a gateway with its prefill
worker, and a decode worker that joins it (`pdserve worker --join`) advertising a relay's address for its KV
instead of its own (the test patches that one attribute in the worker's process: nothing in pdserve routes KV
through a relay). The relay (`test_kv_seal.Relay`, a TCP proxy in this process) parses the prefill worker's
records and flips a byte of one, replays one, and captures the stream. Across hosts is forced on loopback
(`PDSERVE_KV_CROSS_HOST=always`, test-only, in every process). Prefix caching is off, so the same prompt's
KV crosses the wire again each time, the same bytes."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile

import openai
import pytest

from pdserve.bench.netns import reap
from pdserve.bench.server_proc import free_port
from pdserve.transfer.tcp import PREFIX
from serve_util import Server
from test_kv_seal import Relay

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The story of the lighthouse keeper began on a stormy night, when the"
MAX_TOKENS = 8
WORKER = """
import sys
from pdserve.transfer import tcp
init = tcp.TcpReceiver.__init__
def advertised(self, *args, **kwargs):
    init(self, *args, **kwargs)
    with open({target!r}, "w") as f:
        f.write(self.address)
    self.address = {relay!r}
tcp.TcpReceiver.__init__ = advertised
from pdserve.cli import main
sys.exit(main(["worker", "--role", "decode", "--join", {control!r}, "--name", "decode-r", "--num-threads", "1",
               "--no-enable-prefix-caching"]))
"""


@pytest.fixture(scope="module")
def reference():
    from pdserve import LLM, SamplingParams
    llm = LLM(num_threads=2)
    text = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].text
    del llm
    return text


class Wire:
    """What the relay does to the next records: `plan` maps a record's index in the whole run to an action."""

    def __init__(self) -> None:
        self.count, self.plan, self.chunks = 0, {}, []  # chunks: (mode, payload bytes) of every chunk seen

    def edit(self, i: int, record: bytes) -> list[bytes]:
        meta_len, nbytes, _, mode = PREFIX.unpack_from(record)
        if nbytes:
            self.chunks.append((mode, record[PREFIX.size + meta_len:PREFIX.size + meta_len + nbytes]))
        self.count += 1
        action = self.plan.pop(self.count - 1, None)
        if action == "flip" and nbytes:
            out = bytearray(record)
            out[PREFIX.size + meta_len + nbytes // 2] ^= 0x10
            return [bytes(out)]
        if action == "replay":
            return [record, record]
        if action in ("flip",):  # (not a chunk: try the next record)
            self.plan[self.count] = action
        return [record]


@pytest.fixture(scope="module")
def deployment():
    env = {"PDSERVE_DEPLOYMENT_SECRET": secrets.token_hex(32), "PDSERVE_KV_CROSS_HOST": "always"}
    control = free_port()
    target = tempfile.NamedTemporaryFile(prefix="pdserve-kv-target-", delete=False).name
    os.unlink(target)
    wire = Wire()
    relay = Relay(lambda: open(target).read(), wire.edit)
    code = WORKER.format(target=target, relay=relay.address, control=f"tcp://127.0.0.1:{control}")
    log = tempfile.NamedTemporaryFile(prefix="pdserve-decode-r-", suffix=".log", delete=False)
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, **env})
    try:
        server = Server("--transport", "tcp", "--decode", "0", "--control-port", str(control), "--num-threads", "1",
                        "--no-enable-prefix-caching", env=env)
    except RuntimeError:
        worker.kill()
        raise RuntimeError(open(log.name, errors="replace").read()) from None
    try:
        yield server, wire, relay
    finally:
        server.stop()
        reap(worker)
        relay.close()
        for path in (target, log.name):
            if os.path.exists(path):
                os.unlink(path)


def _ask(server: Server, label: str) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"kv_sensitivity": label})
    return out.choices[0].text


def test_changed_and_replayed_chunks_are_refused_and_secret_kv_is_never_plaintext(deployment, reference):
    server, wire, relay = deployment
    failures = lambda: server.metric("pdserve_kv_auth_failures_total", path="tcp")  # noqa: E731
    recomputed = lambda: server.metric("pdserve_kv_transfer_failures_total", reason="failed_checksum",  # noqa: E731
                                       outcome="recompute")
    # public across hosts: authenticated, not encrypted -- the payloads on the wire are the raw KV
    assert _ask(server, "public") == reference
    raw = [payload for mode, payload in wire.chunks if mode == 1]
    assert raw and failures() == 0
    # the same prompt again, public: the same raw bytes cross again (so their absence below means something)
    wire.chunks.clear()
    assert _ask(server, "public") == reference
    assert [payload for mode, payload in wire.chunks if mode == 1] == raw
    # secret: encrypted; no 32-byte piece of that KV is anywhere on the wire
    wire.chunks.clear()
    start = len(relay.captured)
    assert _ask(server, "secret") == reference
    assert wire.chunks and all(mode == 2 for mode, _ in wire.chunks)
    stream = bytes(relay.captured[start:])
    windows = [p[i:i + 32] for p in raw for i in range(0, len(p) - 32, 997)]
    assert windows and not [w for w in windows if w in stream]
    # a byte of a chunk changed on the wire: refused, counted, the prompt recomputed, the answer unchanged
    before, redone = failures(), recomputed()
    wire.plan[wire.count + 3] = "flip"
    assert _ask(server, "internal") == reference
    assert server.wait_metric("pdserve_kv_auth_failures_total", lambda v: v > before, path="tcp") == before + 1
    assert server.wait_metric("pdserve_kv_transfer_failures_total", lambda v: v > redone, reason="failed_checksum",
                              outcome="recompute") > redone
    # a chunk replayed on the wire: the copy refused and counted, the answer unchanged
    before = failures()
    wire.plan[wire.count + 3] = "replay"
    assert _ask(server, "secret") == reference
    assert server.wait_metric("pdserve_kv_auth_failures_total", lambda v: v > before, path="tcp") == before + 1
