"""The prefill worker's books (`pdserve.core.pd.prefill_books`), the torch-free decisions the real prefill worker
and the simulator both drive: what each layer pushes, when a transfer closes, keepalives, loans, landings."""

from pdserve.core.pd.delivery import RELAND_S
from pdserve.core.pd.prefill_books import Landings, Outbound, PrefillBooks


def books(lease_s=30.0):
    b = PrefillBooks(block_size=4, lease_s=lease_s)
    b.open(Outbound("r", "addr", "x1", next_block=1, num_tokens=18, link="d0"))
    return b


def test_a_step_pushes_its_full_blocks_and_advances_only_after_the_last_layer():
    b = books()
    out, span = b.push("r", end=10, advance=False)  # a layer of a step that computed tokens 4..9
    assert (span.first, span.full, span.partial) == (1, 2, False)  # block 1 full; block 2 half, held back
    assert out.next_block == 1  # not yet: the step's other layers push the same blocks
    b.push("r", end=10)
    assert b.outbound["r"].next_block == 2
    _, span = b.push("r", end=18)  # the last step: the tail block goes, partial
    assert (span.first, span.full, span.partial, span.final) == (2, 4, True, True)


def test_a_partly_filled_block_goes_only_with_the_prompts_last_step():
    b = books()
    _, span = b.push("r", end=10)  # block 2 half filled: nothing of it yet (it would be sent again, complete)
    assert (span.full, span.partial, span.num_blocks) == (2, False, 1)
    _, span = b.push("r", end=18)  # blocks 2, 3 and the tail block 4, partly filled
    assert (span.first, span.partial, span.num_blocks) == (2, True, 3)


def test_unknown_or_failed_transfers_push_nothing():
    b = books()
    assert b.push("other", end=8) is None
    b.outbound["r"].failed = "send_timeout"
    assert b.push("r", end=8) is None and b.failed_requests() == ["r"]


def test_a_prefilled_transfer_with_chunks_queued_closes_after_the_last():
    b = books()
    out, now = b.finish("r", prefilled=True, queued=True, first_token=7)
    assert not now and b.closing == {"r": out} and out.first_token == 7 and not b.outbound
    assert b.drained(out) and not b.closing
    assert not b.drained(out)  # once


def test_a_failed_transfer_closes_at_once_with_chunks_queued():
    b = books()
    b.outbound["r"].failed = "send_timeout"
    out, now = b.finish("r", prefilled=True, queued=True)
    assert now and not b.closing and out.failed


def test_an_aborted_or_drained_transfer_closes_at_once():
    b = books()
    assert b.finish("r", prefilled=False, queued=True)[1]  # aborted: closes now, chunks or not
    b.open(Outbound("s", "addr", "x2", 0, 8))
    assert b.finish("s", prefilled=True, queued=False)[1]
    assert b.finish("s", prefilled=True, queued=False) == (None, False)  # ended already


def test_keepalives_are_due_after_a_third_of_the_lease_of_silence():
    b = books(lease_s=30.0)
    out = b.outbound["r"]
    b.sent(out, now=100.0)
    assert b.keepalive_due(109.9) == []
    assert b.keepalive_due(110.0) == [out]
    b.sent(out, now=110.0, alive=True)
    assert b.keepalive_due(115.0) == [] and b.keepalives_sent == 1
    out.failed = "x"
    assert b.keepalive_due(200.0) == []


def test_lent_blocks_go_free_when_taken_or_when_the_lease_ends():
    b = books(lease_s=30.0)
    out = b.outbound["r"]
    out.held.update({3, 4})
    b.finish("r", prefilled=True, queued=False)
    b.lend(out, mark=5, now=100.0)
    assert b.release(120.0, consumed=lambda lent: False) == [] and len(b.lent) == 1
    assert [lent.holder for lent in b.release(120.0, consumed=lambda lent: lent.mark <= 5)] == ["xfer:x1"]
    b.lend(out, mark=9, now=100.0)
    assert len(b.release(130.1, consumed=lambda lent: False)) == 1 and not b.lent
    clean = Outbound("c", "addr", "x3", 0, 4)
    b.lend(clean, mark=1, now=0.0)  # nothing held: nothing lent
    assert not b.lent


def test_a_dead_receiver_ends_its_transfers_and_loans():
    b = books()
    b.open(Outbound("s", "other", "x2", 0, 8))
    held = b.open(Outbound("t", "addr", "x3", 0, 8))
    held.held.add(1)
    b.finish("t", prefilled=True, queued=True)
    b.lend(held, 0, 0.0)
    gone, lent = b.peer_gone("addr")
    assert sorted(o.rid for o in gone) == ["r", "t"] and len(lent) == 1
    assert list(b.outbound) == ["s"] and not b.closing and not b.lent


def test_a_landing_is_reported_again_only_when_it_moved_past_the_threshold():
    lands = Landings()
    lands.report("a", 10.0)
    lands.report("b", 10.0)
    eta = {"a": 5.0 + RELAND_S / 2, "b": 5.0 + 2 * RELAND_S}
    assert lands.moved(5.0, eta.get) == [("b", eta["b"])]
    assert lands.reported["b"] == 5.0 + eta["b"]
    assert lands.moved(5.0, lambda rid: None) == [] and not lands  # left the link: forgotten


def test_unproduced_bytes_count_the_transfers_taken_for_a_link_but_not_yet_computed():
    b = books()  # r: 18 tokens in blocks of 4 -> 5 blocks, from block 1: 4 to go
    other = b.open(Outbound("s", "addr", "x2", 0, 8, link="d0", tier="flex"))  # 2 blocks
    b.open(Outbound("t", "addr", "x3", 0, 8, link="d1"))  # another link
    assert b.unproduced_bytes("d0", {"default", "flex"}, 10.0) == 60.0
    assert b.unproduced_bytes("d0", {"default"}, 10.0) == 40.0
    assert b.unproduced_bytes("d0", {"default", "flex"}, 10.0, but=other) == 40.0
    b.push("r", end=12)  # 3 blocks computed: 2 to go
    assert b.unproduced_bytes("d0", {"default"}, 10.0) == 20.0
