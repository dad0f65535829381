"""`--transport mooncake` (`pdserve.transfer.mooncake`): KV payloads by one-sided write through a real Mooncake
Transfer Engine (its TCP protocol, P2P handshake), headers over tcp. The bytes arrive whole through a ring that
wraps; a label that asks for encryption is encrypted before the engine sees it (the receiver's ring never
holds the plaintext); a payload changed on the way, or replayed, is refused and its transfer recomputed, with
the same tokens as one engine; the same greedy text as the in-process `LLM` through `pdserve serve`; without
the package `--transport mooncake` is a one-line error."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from pdserve.mooncake import unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

SECRET = bytes(range(32))


class Polled:
    """A receiver polled by a thread of its own (a sender's open and a full ring wait for the receiver's poll,
    as a decode worker's loop polls while it expects KV), collecting what arrives."""

    def __init__(self, receiver) -> None:
        self.receiver, self.got, self._stop = receiver, [], False
        self.polling = threading.Event()  # cleared: the receiver is not read (a busy decode worker)
        self.polling.set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            if self.polling.wait(0.05):
                self.got.extend(self.receiver.poll(5))

    def wait(self, n: int, timeout_s: float = 10.0) -> list:
        deadline = time.monotonic() + timeout_s
        while len(self.got) < n:
            assert time.monotonic() < deadline, f"{len(self.got)} of {n} records arrived"
            time.sleep(0.005)
        return self.got

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.receiver.close()


@pytest.fixture
def link(monkeypatch):
    from pdserve.transfer.mooncake import MooncakeReceiver, MooncakeSender

    made = []

    def make(cross_host=False, **sender_kw):
        if cross_host:  # both ends count the loopback path as crossing hosts (test-only)
            monkeypatch.setenv("PDSERVE_KV_CROSS_HOST", "always")
        receiver = Polled(MooncakeReceiver(ring_bytes=3 << 20, secret=SECRET))
        sender = MooncakeSender(timeout_s=5.0, secret=SECRET, **sender_kw)
        made.append((sender, receiver))
        return sender, receiver

    yield make
    for sender, receiver in made:
        sender.close()
        receiver.close()


def _chunk(i: int, label: str) -> dict:
    return {"kind": "chunk", "xfer": "x", "layer": i, "first": 0, "count": 1, "label": label}


@pytest.mark.parametrize("label,cross_host,mode", [("internal", False, "plain"), ("public", True, "mac"),
                                                   ("secret", False, "aead")])
def test_payloads_arrive_whole_through_a_wrapping_ring(link, label, cross_host, mode):
    sender, polled = link(cross_host)
    payloads = [os.urandom((1 << 20) - 4096 * i) for i in range(7)]  # 7 MiB through a 3 MiB ring
    for i, data in enumerate(payloads):
        sender.send_chunk(polled.receiver.address, _chunk(i, label), [memoryview(data[:1000]), memoryview(data[1000:])])
    sender.send_control(polled.receiver.address, {"kind": "done", "xfer": "x", "num_chunks": len(payloads)})
    got = polled.wait(len(payloads) + 1)
    assert [r.header["kind"] for r in got] == ["chunk"] * len(payloads) + ["done"]
    assert all(r.verified for r in got[:-1]) and [r.payload for r in got[:-1]] == payloads
    assert [r.header["nbytes"] for r in got[:-1]] == [len(p) for p in payloads]
    assert sender.protected_bytes[mode] == sum(map(len, payloads)) and polled.receiver.auth_failures == 0
    (channel,) = polled.receiver._channels.values()
    ring = bytes(channel.ring.view)
    # what the engine carried: the plaintext (plain, mac) or only ciphertext (aead: sealed before the write)
    assert (payloads[-1][:4096] in ring) is (mode != "aead")


def test_a_sender_waits_for_room_in_the_ring(link):
    """A receiver that stops reading: the sender waits (reading the ring's consumed mark) instead of writing
    over payloads not yet read; every payload arrives whole once the receiver reads again."""
    sender, polled = link()
    payloads = [os.urandom(1 << 20) for _ in range(7)]  # the ring holds 3
    sender.send_chunk(polled.receiver.address, _chunk(0, "internal"), [memoryview(payloads[0])])
    polled.wait(1)
    polled.polling.clear()
    time.sleep(0.05)  # (a poll under way ends)
    sent = []
    thread = threading.Thread(target=lambda: [sent.append(sender.send_chunk(
        polled.receiver.address, _chunk(i, "internal"), [memoryview(d)])) for i, d in enumerate(payloads[1:], 1)])
    thread.start()
    deadline = time.monotonic() + 5
    while len(sent) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)  # (room for a sender that would not wait to run over unread payloads)
    polled.polling.set()
    thread.join(10)
    got = polled.wait(7)
    assert all(r.verified for r in got) and [r.payload for r in got] == payloads


@pytest.mark.parametrize("label,cross_host", [("internal", False), ("public", True), ("secret", False)])
def test_a_changed_payload_is_refused(link, label, cross_host):
    from pdserve.transfer.base import FaultInjector
    sender, polled = link(cross_host, faults=FaultInjector(every=2))
    data = [os.urandom(256 << 10) for _ in range(4)]
    for i, d in enumerate(data):
        sender.send_chunk(polled.receiver.address, _chunk(i, label), [memoryview(d)])
    got = polled.wait(4)
    assert [r.verified for r in got] == [True, False, True, False]
    assert polled.receiver.auth_failures == (0 if label == "internal" else 2)  # (plain: a checksum, not a tag)


def test_a_replayed_or_forged_payload_header_is_refused(link):
    sender, polled = link()
    d = os.urandom(64 << 10)
    sender.send_chunk(polled.receiver.address, _chunk(0, "secret"), [memoryview(d)])
    (ch,) = sender._channels.values()
    # the same header again (its counter already accepted), as a replay on the path would send it
    sender._control.send_control(ch.ctl, {**_chunk(0, "secret"), "mc": [ch.nonce, 0, 0, len(d) + 16, "aead", 0]})
    # and headers no sender of ours writes: a malformed one, one pointing outside the ring (none crashes the poll)
    sender._control.send_control(ch.ctl, {**_chunk(1, "internal"), "mc": [ch.nonce, 5, -1]})
    sender._control.send_control(ch.ctl, {**_chunk(1, "internal"), "mc": [ch.nonce, 6, -(3 << 20), 64, "plain", 0]})
    first, again, malformed, outside = polled.wait(4)
    assert first.verified and first.payload == d
    assert not again.verified and "replayed" in again.header["reason"]
    assert not malformed.verified and "malformed" in malformed.header["reason"]
    assert not outside.verified and "outside the ring" in outside.header["reason"]
    assert polled.receiver.auth_failures == 3


def test_pd_tokens_equal_single_engine_over_mooncake(tiny_llama_dir, tmp_path):
    from test_pd_engine import Pair, _prompts, _reference
    from pdserve.transfer.base import FaultInjector
    prompts = _prompts(3)
    expected = _reference(tiny_llama_dir, prompts)
    for faults in (None, FaultInjector(every=3)):
        pair = Pair(tiny_llama_dir, "mooncake", tmp_path, faults=faults)
        try:
            assert pair.run(prompts) == expected and pair.decode.stats.bytes_received > 0
            if faults is None:
                assert pair.outcomes == ["delivered"] * len(prompts)
            else:  # a changed chunk failed its checksum: its transfer recomputed, the chunk never consumed
                assert "recompute" in pair.outcomes and pair.decode.stats.failures["failed_checksum"] >= 1
            pair.assert_no_leak()
        finally:
            pair.close()


def test_without_the_package_transport_mooncake_is_one_line(tmp_path):
    (tmp_path / "mooncake.py").write_text("")  # shadows the package: `mooncake.engine` does not import
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--transport", "mooncake"],
                          capture_output=True, text=True, env=env, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: --transport mooncake: Mooncake is not usable here")
    assert "pip install 'pdserve[mooncake]'" in lines[0] and "libibverbs1" in lines[0]


def test_joined_workers_need_a_tcp_path(monkeypatch):
    """A worker that joins delivers and takes KV over tcp: a pd deployment on mooncake alone cannot take one."""
    from pdserve.errors import InvalidRequestError
    from pdserve.server.launch import ServeConfig
    from pdserve.transfer import peer_auth
    monkeypatch.setenv(peer_auth.ENV, peer_auth.new_secret())
    with pytest.raises(InvalidRequestError, match=r"^--control-port in pd mode needs --transport tcp or auto: "):
        ServeConfig(transport="mooncake", control_port=5557)
    assert ServeConfig(transport="mooncake", mode="colocated", control_port=5557).transport == "mooncake"
    with pytest.raises(InvalidRequestError, match=r"^--cluster ray delivers KV over tcp: --transport mooncake is not"):
        ServeConfig(transport="mooncake", cluster="ray")  # (not silently tcp)


@pytest.mark.slow
def test_serve_over_mooncake_gives_the_same_text(reference):
    from serve_util import Server
    from test_serve import MODEL, check_completions_and_chat, client
    server = Server("--transport", "mooncake")
    try:
        check_completions_and_chat(server, reference, (0, 1))
        assert server.wait_metric("pdserve_kv_transfer_time_seconds_count", lambda v: v >= 3, outcome="delivered") >= 3
        assert server.metric("pdserve_kv_transfer_failures_total") == 0
        assert server.metric("pdserve_kv_transfer_time_seconds_count", outcome="recompute") == 0
        resp = client(server).completions.create(model=MODEL, prompt="The capital of Japan is", max_tokens=8,
                                                 temperature=0, extra_body={"kv_sensitivity": "secret"})
        assert resp.choices[0].text
        sent = "pdserve_kv_protected_bytes_total"  # secret KV encrypted before the engine took it, the rest plain
        assert server.wait_metric(sent, lambda v: v > 0, path="mooncake", mode="aead") > 0
        assert server.metric(sent, path="mooncake", mode="plain") > 0
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def reference():
    """The in-process `LLM`'s greedy text for the two prompts and the chat the serve test sends."""
    from pdserve import LLM, SamplingParams
    from test_serve import CHAT, MAX_TOKENS, PROMPTS
    llm = LLM(num_threads=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    texts = [o.text for o in llm.generate(PROMPTS[:2], params)]
    chat = llm.chat(CHAT, params)[0].text
    del llm
    return {"completions": texts, "chat": chat}
