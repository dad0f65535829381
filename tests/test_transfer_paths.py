"""Path choice (`--transport auto`): each transfer on the path measured best for its pair, a failed path
avoided and a transfer moved off it at its first chunk (`pdserve.transfer.paths`), over the real shm and tcp
transports."""

from __future__ import annotations

import uuid

import openai
import pytest

from pdserve.transfer import make_receiver, make_sender
from pdserve.transfer.base import TransferError
from pdserve.transfer.paths import PROBE_TRANSFERS, REPROBE_EVERY, PathChooser, parse_dest
from serve_util import Server, wait_for


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_chooser_probes_each_path_then_takes_the_fastest_and_reprobes_the_other():
    chooser = PathChooser(Clock())
    paths = ["shm", "tcp"]
    probes = [chooser.pick("d", paths) for _ in range(2 * PROBE_TRANSFERS)]
    assert sorted(probes) == ["shm"] * PROBE_TRANSFERS + ["tcp"] * PROBE_TRANSFERS
    chooser.observe("d", "shm", 1 << 20, 0.001)
    chooser.observe("d", "tcp", 1 << 20, 0.004)  # four times slower per byte
    picks = [chooser.pick("d", paths) for _ in range(3 * REPROBE_EVERY)]
    assert picks.count("tcp") == 3 and picks.count("shm") == 3 * REPROBE_EVERY - 3  # one in REPROBE_EVERY
    chooser.observe("d", "tcp", 1 << 20, 0.0001)  # the other path got faster: it takes over
    for _ in range(20):
        chooser.observe("d", "tcp", 1 << 20, 0.0001)
    picks = [chooser.pick("d", paths) for _ in range(REPROBE_EVERY)]
    assert picks.count("tcp") == REPROBE_EVERY - 1  # shm only for its reprobe
    # per destination: another decode worker starts with its own probes
    assert chooser.stats.get(("e", "shm")) is None


def test_a_failed_path_is_avoided_for_a_while():
    clock = Clock()
    chooser = PathChooser(clock)
    for _ in range(2 * PROBE_TRANSFERS):
        chooser.pick("d", ["shm", "tcp"])
    chooser.observe("d", "shm", 1000, 0.0001)
    chooser.observe("d", "tcp", 1000, 0.01)
    chooser.breakers.of("d", "shm").failed(clock.t, seconds=chooser.breakers.policy.slow_s)  # its breaker opens
    assert {chooser.pick("d", ["shm", "tcp"]) for _ in range(10)} == {"tcp"}
    clock.t = chooser.breakers.policy.cool_s + 0.001  # half-open: it may take a probe
    assert chooser.pick("d", ["shm", "tcp"]) == "shm"
    assert chooser.pick("d", ["shm"], exclude="shm") is None


def test_addresses():
    assert parse_dest("paths:shm=ipc:///tmp/a;tcp=tcp://127.0.0.1:5") == {"shm": "ipc:///tmp/a",
                                                                          "tcp": "tcp://127.0.0.1:5"}
    assert parse_dest("tcp://h:1") == {"tcp": "tcp://h:1"} and parse_dest("ipc:///x") == {"shm": "ipc:///x"}
    with pytest.raises(ValueError):
        parse_dest("udp://x")


def _chunk(xfer: str, i: int) -> tuple[dict, list[memoryview]]:
    payload = memoryview(bytes([i % 251]) * 4096)
    return {"kind": "chunk", "xfer": xfer, "layer": 0, "first": i, "count": 1}, [payload]


def _drain(receiver, want: int) -> list:
    got = []
    for _ in range(200):
        got += receiver.poll(10)
        if len(got) >= want:
            break
    return got


def test_transfers_go_over_both_real_transports_and_move_off_a_broken_one(tmp_path):
    receiver = make_receiver("auto", f"ipc://{tmp_path}/kv-{uuid.uuid4().hex[:8]}")
    sender = make_sender("auto", ring_mb=1, timeout_s=2.0)
    dest = receiver.address
    assert dest.startswith("paths:") and set(parse_dest(dest)) == {"shm", "tcp"}
    try:
        for t in range(2 * PROBE_TRANSFERS):  # the probes: each transfer on one path, its done after it
            for i in range(3):
                sender.send_chunk(dest, *_chunk(f"x{t}", i))
            sender.send_control(dest, {"kind": "done", "xfer": f"x{t}", "num_chunks": 3, "first_token": 1})
        got = _drain(receiver, 4 * 4)
        assert len(got) == 16 and all(m.verified for m in got if m.header["kind"] == "chunk")
        for t in range(2 * PROBE_TRANSFERS):  # per transfer: its chunks, then its done
            kinds = [m.header["kind"] for m in got if m.header["xfer"] == f"x{t}"]
            assert kinds == ["chunk"] * 3 + ["done"]
        assert sender.transfers == {"shm": PROBE_TRANSFERS, "tcp": PROBE_TRANSFERS}
        # the shm path breaks: a transfer starting there moves to tcp at its first chunk
        shm = sender.senders["shm"]

        def broken(*args, **kwargs):
            raise TransferError("test: ring unusable")

        shm.send_chunk = broken
        sender.chooser.stats[(dest, "shm")].seconds_per_byte = 0.0  # measured fastest: it is picked first
        sender.chooser.stats[(dest, "tcp")].seconds_per_byte = 1.0
        sender.send_chunk(dest, *_chunk("y", 0))
        assert sender.failovers == 1 and sender._xfers["y"] == "tcp"  # noqa: SLF001
        with pytest.raises(TransferError):  # a failure in the middle of a transfer fails it, as on one path
            sender._xfers["z"] = "shm"  # noqa: SLF001
            sender.send_chunk(dest, *_chunk("z", 1))
        assert [m.header["xfer"] for m in _drain(receiver, 1)] == ["y"]
    finally:
        sender.close()
        receiver.close()


@pytest.mark.slow
def test_serve_with_transport_auto_probes_both_paths_and_delivers_every_transfer():
    server = Server("--transport", "auto")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        texts = [client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"Note {i}: " + "the tide rises " * 30,
                                           max_tokens=8, temperature=0).choices[0].text for i in range(4)]
        assert all(texts)
        # the workers' stats
        assert server.wait_metric("pdserve_kv_path_transfers_total", lambda v: v >= 4, worker="prefill-0") == 4
        assert server.metric("pdserve_kv_path_transfers_total", worker="prefill-0", path="shm") == 2
        assert server.metric("pdserve_kv_path_transfers_total", worker="prefill-0", path="tcp") == 2
        assert server.metric("pdserve_kv_transfer_time_seconds_count", outcome="delivered") == 4
        assert server.metric("pdserve_kv_transfer_failures_total") == 0
    finally:
        server.stop()


def test_a_sender_of_one_transport_takes_its_own_path_of_a_composite_address():
    # a worker that joined a `--transport auto` deployment (tcp) is handed the decode worker's composite address
    receiver = make_receiver("auto", "ipc:///tmp/pdserve-onepath-test", "127.0.0.1")
    sender = make_sender("tcp", timeout_s=2.0)
    try:
        assert receiver.address.startswith("paths:")
        sender.send_chunk(receiver.address, {"kind": "chunk", "xfer": "x"}, [memoryview(b"kv" * 512)])
        got = wait_for(lambda: receiver.poll(50), timeout_s=5.0)
        assert [g.payload for g in got] == [b"kv" * 512]
        assert set(sender.sender._sockets) == {parse_dest(receiver.address)["tcp"]}  # the tcp path, not shm
        # a peer with no path of this transport: refused at once, named (no connect is tried)
        with pytest.raises(TransferError, match="no tcp path"):
            sender.send_chunk("paths:shm=ipc:///tmp/x", {"kind": "chunk", "xfer": "y"}, [memoryview(b"z")])
        with pytest.raises(TransferError, match="expected ipc://"):
            sender.send_control("udp://h:1", {"kind": "done", "xfer": "y"})
    finally:
        sender.close()
        receiver.close()
