"""Transports by name (`pdserve.transfer.TRANSPORTS`) and their declared capabilities: every name check reads
the one table, a transport registered in a test is accepted everywhere with no caller changed, and the prefill
side reads a sender's capabilities instead of probing its methods."""

from __future__ import annotations

import pytest

from pdserve import transfer
from pdserve.engine.pd import PrefillSide
from pdserve.errors import InvalidRequestError
from pdserve.server.launch import ServeConfig
from pdserve.transfer.base import Capabilities
from pdserve.transfer.paths import PathSender
from pdserve.transfer.tcp import TcpReceiver, TcpSender
from test_pd_engine import _engine


class CopyingSender(TcpSender):
    """A transport of the test's: tcp's wire, and a `share_source` it declares it does not use."""

    capabilities = Capabilities(zero_copy=False, cross_host=True)
    shared = None

    def share_source(self, handle, buffer) -> None:
        self.shared = handle


class SharingSender(CopyingSender):
    capabilities = Capabilities(zero_copy=True, cross_host=False)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(transfer, "TRANSPORTS", dict(transfer.TRANSPORTS))
    transfer.TRANSPORTS["copy"] = transfer.Transport(CopyingSender, lambda ring_mb, timeout_s: CopyingSender(timeout_s),
                                                     lambda address, host: TcpReceiver(host))
    return transfer.TRANSPORTS


def test_each_transport_declares_its_capabilities():
    assert transfer.names() == ("shm", "tcp", "mooncake", "auto")
    assert transfer.capabilities("shm") == Capabilities(zero_copy=True, cross_host=False)
    assert transfer.capabilities("tcp") == Capabilities(zero_copy=False, cross_host=True)
    assert transfer.capabilities("auto") == Capabilities(zero_copy=True, cross_host=True)
    sender = transfer.make_sender("auto", ring_mb=1)
    assert sender.capabilities == transfer.capabilities("auto") and sender.max_chunk_bytes == (1 << 20) // 4
    sender.close()


def test_an_unknown_transport_is_a_one_line_error():
    for make in (lambda: transfer.make_sender("udp"), lambda: transfer.make_receiver("udp"),
                 lambda: ServeConfig(transport="udp")):
        with pytest.raises(InvalidRequestError, match=r"^--transport must be shm, tcp, mooncake or auto, got 'udp'$") as e:
            make()
        assert e.value.param == "transport"


def test_a_registered_transport_is_accepted_everywhere(registered):
    assert transfer.names() == ("shm", "tcp", "mooncake", "copy", "auto")
    assert ServeConfig(transport="copy").transport == "copy"
    sender, receiver = transfer.make_sender("copy"), transfer.make_receiver("copy")
    assert isinstance(sender.sender, CopyingSender) and receiver.address.startswith("tcp://")
    auto = transfer.make_sender("auto", ring_mb=1)
    assert isinstance(auto, PathSender) and set(auto.senders) == {"shm", "tcp", "copy"}
    for s in (sender, auto):
        s.close()
    receiver.close()


def test_the_prefill_side_reads_capabilities_not_methods(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, shared_kv=True)
    copying, sharing = CopyingSender(), SharingSender()
    for sender in (copying, sharing):
        PrefillSide(engine, sender, engine.executor.kv_pool.layers)
    assert copying.shared is None and sharing.shared == engine.executor.kv_pool.handle
    # auto hands the pool only to the paths that declare zero copy
    paths = PathSender({"copy": CopyingSender(), "share": SharingSender()})
    paths.share_source("h", b"")
    assert (paths.senders["copy"].shared, paths.senders["share"].shared) == (None, "h")
