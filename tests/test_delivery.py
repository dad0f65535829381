"""Delivery scheduling (`pdserve.core.pd.delivery`) and the simulator's links that use it: shares per tier,
earliest deadline first within a tier, work conservation, landing estimates, throttling."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.pd.delivery import DeliveryPolicy, Item, LinkQueue, TokenBucket, _equal_split
from pdserve.core.settings import parse_link_share
from pdserve.errors import InvalidRequestError
from pdserve.sim.events import EventLoop
from pdserve.sim.link import LinkModel

SHARES = {"priority": 0.5, "default": 0.4, "flex": 0.1}


def test_link_share_is_parsed_and_normalized():
    assert parse_link_share("priority=5,default=4,flex=1") == pytest.approx(SHARES)
    assert parse_link_share(None) == SHARES
    assert parse_link_share("flex=2") == {"flex": 1.0}
    for bad in ("gold=1", "priority", "priority=-1", "priority=x", "priority=0,flex=0", "priority=inf"):
        with pytest.raises(InvalidRequestError, match="--link-share"):
            parse_link_share(bad)
    with pytest.raises(InvalidRequestError, match="delivery"):
        DeliveryPolicy("lifo")


def test_scheduled_rates_follow_shares_then_deadlines():
    policy = DeliveryPolicy("scheduled", SHARES)
    late, early = Item("late", "priority", 2.0), Item("early", "priority", 1.0)
    default, flex = Item("d", "default", 0.5), Item("f", "flex", 0.1)
    rates = policy.rates([late, early, default, flex], 100.0)
    # every tier backlogged: its share; within the tier, all of it to the earliest deadline
    assert rates[early] == pytest.approx(50.0) and rates[late] == 0.0
    assert rates[default] == pytest.approx(40.0) and rates[flex] == pytest.approx(10.0)
    # the earliest capped by its production rate: the next one takes the rest of the tier's share
    early.cap = 20.0
    rates = policy.rates([late, early, default, flex], 100.0)
    assert rates[early] == pytest.approx(20.0) and rates[late] == pytest.approx(30.0)
    # a tier without demand lends its share to the others, in proportion to theirs
    rates = policy.rates([default, flex], 100.0)
    assert rates[default] == pytest.approx(80.0) and rates[flex] == pytest.approx(20.0)


def test_fifo_rates_split_equally_and_pass_on_what_a_capped_flow_leaves():
    a, b, c = Item("a", cap=10.0), Item("b"), Item("c")
    rates = DeliveryPolicy("fifo").rates([a, b, c], 100.0)
    assert rates[a] == pytest.approx(10.0) and rates[b] == pytest.approx(45.0) and rates[c] == pytest.approx(45.0)


items = st.lists(st.tuples(st.sampled_from(["priority", "default", "flex"]), st.floats(0, 10),
                           st.one_of(st.just(float("inf")), st.floats(0.1, 200))), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(items, st.sampled_from(["scheduled", "fifo"]), st.floats(1, 1000))
def test_rates_are_work_conserving_and_respect_caps(spec, mode, capacity):
    flows = [Item(i, tier, deadline, cap=cap) for i, (tier, deadline, cap) in enumerate(spec)]
    rates = DeliveryPolicy(mode, SHARES).rates(flows, capacity)
    assert all(-1e-9 <= rates[f] <= f.cap * (1 + 1e-9) for f in flows)
    want = min(capacity, sum(f.cap for f in flows))
    assert sum(rates.values()) == pytest.approx(want, rel=1e-6)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["priority", "default", "flex", "other"]), st.one_of(st.just(float("inf")), st.floats(0, 1e12)),
       st.floats(1, 1e12), st.sampled_from(["scheduled", "fifo"]), st.booleans())
def test_a_flow_alone_on_its_link_gets_what_the_split_gives_it(tier, cap, capacity, mode, due):
    """`rates` answers a lone flow directly (the simulator's common case): min(cap, capacity), what the
    split gives it up to its float rounding (a tier's share is multiplied in and divided out again there)."""
    it = Item(0, tier, 1.0, cap=cap)
    it.due = due
    policy = DeliveryPolicy(mode, SHARES)
    if mode == "fifo":
        general = _equal_split([it], capacity)[it]
    else:
        out = {it: 0.0}
        policy._share_out([it], out, capacity)
        general = out[it]
    assert policy.rates([it], capacity)[it] == pytest.approx(general, rel=1e-12)


def test_pick_gives_each_backlogged_tier_its_share_and_the_earliest_deadline_first():
    queue = LinkQueue(DeliveryPolicy("scheduled", SHARES))
    for i in range(200):
        for tier in ("priority", "default", "flex"):
            queue.push((tier, i), 1000, tier, deadline_s=float(200 - i))  # later pushes are due earlier
    sent = {"priority": 0, "default": 0, "flex": 0}
    order = {"priority": []}
    for _ in range(300):
        item = queue.pick()
        sent[item.tier] += item.nbytes
        if item.tier == "priority":
            order["priority"].append(item.deadline_s)
    total = sum(sent.values())
    for tier, share in SHARES.items():
        assert sent[tier] / total == pytest.approx(share, abs=0.01)
    assert order["priority"] == sorted(order["priority"])


def test_fifo_pick_is_push_order_and_a_tier_back_from_idle_gets_no_credit():
    queue = LinkQueue(DeliveryPolicy("fifo"))
    for i in range(5):
        queue.push(i, 10, "flex" if i % 2 else "priority")
    assert [queue.pick().key for _ in range(5)] == list(range(5))
    sched = LinkQueue(DeliveryPolicy("scheduled", SHARES))
    for i in range(100):
        sched.push(("default", i), 100, "default")
    for _ in range(100):
        sched.pick()  # default alone for a while
    for i in range(50):
        sched.push(("default", 100 + i), 100, "default")
        sched.push(("priority", i), 100, "priority")
    first = [sched.pick().tier for _ in range(18)]
    # priority was idle: it gets its share from now on (5:4), not the whole link to catch up
    assert 8 <= first.count("priority") <= 11


def test_bytes_until_is_what_pick_sends_first():
    queue = LinkQueue(DeliveryPolicy("scheduled", SHARES))
    for i in range(30):
        queue.push(("x" if i % 3 == 0 else "y", i), 100 + i, ["priority", "default", "flex"][i % 3], float(i % 7))
    mine = lambda it: it.key[0] == "x"  # noqa: E731
    expected = queue.bytes_until(mine)
    assert _sent_until(queue, mine) == expected


def _sent_until(queue: LinkQueue, mine) -> float:
    """Bytes `pick` sends until the last of `mine` is out."""
    sent, left = 0.0, sum(1 for it in queue.items if mine(it))
    while left:
        item = queue.pick()
        sent += item.nbytes
        left -= mine(item)
    return sent


def test_a_due_transfers_bytes_until_is_what_pick_sends_first_within_an_item_per_tier():
    """The landing estimate of a prefilled (due) transfer comes from the tiers' virtual times, not a replay:
    off by at most one item of each other tier."""
    import random
    rng = random.Random(3)
    for trial in range(20):
        queue = LinkQueue(DeliveryPolicy("scheduled", SHARES))
        for i in range(300):  # 25 transfers, each of one tier
            tier = ["priority", "default", "flex"][(i % 25) % 3]
            queue.push((f"t{i % 25}", i), rng.randint(100, 5000), tier, float(rng.random() * 10))
        for _ in range(rng.randint(0, 100)):
            queue.pick()
        for t in rng.sample(range(25), 6):  # some transfers prefilled: due
            queue.expedite(lambda it, t=t: it.key[0] == f"t{t}", float(t))
        target = rng.choice([it.key[0] for it in queue.items if it.due])
        mine = lambda it: it.key[0] == target  # noqa: E731
        estimate = queue.bytes_until(mine)
        sent = _sent_until(queue, mine)
        assert abs(sent - estimate) <= 2 * 5000, (trial, sent, estimate)


def test_token_bucket_throttles_to_its_rate():
    bucket = TokenBucket(rate=1000.0, burst=100.0)
    t, sent = 0.0, 0
    while t < 10.0:
        wait = bucket.wait_s(t)
        if wait > 0:
            t += wait
            continue
        bucket.take(250, t)
        sent += 250
    assert sent == pytest.approx(10_000, rel=0.05)


def _links(mode: str):
    loop = EventLoop()
    return loop, LinkModel(loop, latency_s=0.0, policy=DeliveryPolicy(mode, SHARES))


@pytest.mark.parametrize("mode", ["scheduled", "fifo"])
def test_simulated_port_order_and_landing_estimate(mode):
    """Two flows on one saturated port: scheduled sends the earlier deadline first at full rate, fifo
    shares. A flow's landing estimate (`eta`, which makes it due now) is when it lands if nothing else
    starts."""
    for expedite in ("early", "late"):
        loop, links = _links(mode)
        port = links.link("p", 100.0)
        landed = {}
        for name, deadline in (("late", 9.0), ("early", 1.0)):
            links.start((port,), 100.0, 0.0, lambda n=name: landed.setdefault(n, loop.now), deadline_s=deadline)
        flows = {("late", "early")[i]: f for i, f in enumerate(links.flows)}
        eta = links.eta([flows[expedite]])
        loop.run(100.0)
        assert eta == pytest.approx(landed[expedite])
        if mode == "fifo":
            assert landed == pytest.approx({"late": 2.0, "early": 2.0})
        else:  # the due one first: the earlier deadline, or the one made due now
            other = "late" if expedite == "early" else "early"
            assert landed == pytest.approx({expedite: 1.0, other: 2.0})


def test_a_transfers_next_chunk_rides_its_flow_in_order_behind_what_it_has_produced():
    """A 200 B/s port: 300 bytes produced over 1 s leave 100 queued at t = 1; the next chunk, 100 bytes
    produced over 2 s, joins that flow (one flow per transfer). Its queued bytes go first at the port's rate,
    then it is held to its production: caught up at t = 1.667 (100 queued + 25 produced sent by t = 1.5),
    landing with the last byte produced at t = 3 — as the landing estimate says."""
    loop, links = _links("scheduled")
    port = links.link("p", 200.0)
    landed = []
    flow = links.start((port,), 300.0, 1.0, lambda: landed.append(loop.now))
    loop.at(1.0, lambda: None)
    loop.run(1.0)
    assert links.queued_bytes(port, {"default"}) == pytest.approx(100.0)
    assert links.extend(flow, 100.0, 2.0) and len(links.flows) == 1
    eta = links.eta([flow], expedite=False)
    loop.at(1.5, lambda: None)
    loop.run(1.5)
    assert links.queued_bytes(port, {"default"}) == pytest.approx(100.0)  # 200 - 100 sent in 0.5 s
    loop.run(100.0)
    assert landed == pytest.approx([3.0]) and 1.0 + eta == pytest.approx(3.0)
    assert not links.extend(flow, 10.0, 0.1)  # landed: the next chunk starts a flow of its own


def test_a_transfer_from_another_prefill_engine_moves_a_landing_on_the_shared_decode_port():
    """Prefill ports p0 and p1 (1,000 B/s) both send to decode port d (100 B/s). A (default, p0) is due:
    alone it lands in 1 s. B (priority, p1) becomes due at 0.5 s and takes d's priority share: `sharing`
    names p0's engine, whose watch reports A's new landing, which is when A lands."""
    from types import SimpleNamespace

    from pdserve.sim.link import LandingWatch
    loop, links = _links("scheduled")
    p0, p1, d = links.link("p0", 1000.0), links.link("p1", 1000.0), links.link("d", 100.0)
    watch, landed = LandingWatch(links), {}
    a = SimpleNamespace(rid="a", finished=False, in_air=[
        links.start((p0, d), 100.0, 0.0, lambda: landed.setdefault("a", loop.now), tier="default")])
    assert watch.moved("prefill-0", a, links.eta(a.in_air), 0.0) == [] and links.eta(a.in_air) == pytest.approx(1.0)
    loop.at(0.5, lambda: None)
    loop.run(0.5)
    b = SimpleNamespace(rid="b", finished=False, in_air=[
        links.start((p1, d), 100.0, 0.0, lambda: landed.setdefault("b", loop.now), tier="priority")])
    assert watch.moved("prefill-1", b, links.eta(b.in_air), 0.5) == []  # p1 has nothing else in the air
    assert watch.sharing(b) == ["prefill-0"]
    [(rid, eta)] = watch.recheck("prefill-0", 0.5)
    loop.run(100.0)
    assert rid == "a" and 0.5 + eta == pytest.approx(landed["a"]) and landed["a"] > 1.1


def test_a_landing_estimate_moves_when_another_transfer_becomes_due_and_is_exact_again():
    """A due default transfer has the port to itself; a priority one made due later takes its share: the
    first estimate (made when it alone was due) is early, the re-estimate (`expedite=False`: its place in
    the order kept) is when it lands."""
    loop, links = _links("scheduled")
    port = links.link("p", 100.0)
    landed = {}
    a = links.start((port,), 100.0, 0.0, lambda: landed.setdefault("a", loop.now), tier="default")
    first = links.eta([a])  # alone: 1 s
    loop.at(0.5, lambda: None)
    loop.run(0.5)
    assert loop.now == pytest.approx(0.5)
    b = links.start((port,), 100.0, 0.0, lambda: landed.setdefault("b", loop.now), tier="priority")
    links.eta([b])  # b due now: the two due transfers share the port by tier (0.5 : 0.4)
    again = links.eta([a], expedite=False)
    loop.run(100.0)
    assert first == pytest.approx(1.0) and landed["a"] > first + 0.1
    assert 0.5 + again == pytest.approx(landed["a"])


def test_a_real_links_landing_estimates_are_reported_again_when_they_move():
    """`PrefillSide.relanded` over the real `Outbox`: a prefilled default transfer queued on a throttled
    link; a priority one prefilled after it shares the link by tier: the default one's landing is reported
    again (later), once."""
    from types import SimpleNamespace

    from pdserve.core.pd.prefill_books import PrefillBooks
    from pdserve.engine.pd import PrefillSide
    from pdserve.transfer.outbox import Chunk, Outbox

    class Out:
        def __init__(self, xfer: str, tier: str) -> None:
            self.xfer, self.rid, self.tier, self.link, self.dest = xfer, xfer, tier, "decode-0", "d"
            self.deadline_s, self.failed, self.by_copy = 1.0, None, False

    box = Outbox(sender=None, policy=DeliveryPolicy("scheduled"), hold=lambda out, ids: None, link_rate=1e6)
    side = SimpleNamespace(outbox=box, books=PrefillBooks(16, 30.0))
    a, b = Out("a", "default"), Out("b", "priority")
    for out in (a, b):
        side.books.outbound[out.rid] = out
        for _ in range(10):
            box.push(Chunk(out, {}, [], 100_000, [0]))  # 1 MB each: a second of the link
    first = PrefillSide.landing_in_s(side, "a")  # prefilled: due, alone among due transfers
    side.books.closing["a"] = side.books.outbound.pop("a")
    assert first == pytest.approx(1.0) and PrefillSide.relanded(side) == []
    PrefillSide.landing_in_s(side, "b")  # prefilled too: the two due transfers share the link 0.4 : 0.5
    side.books.closing["b"] = side.books.outbound.pop("b")
    (moved,) = PrefillSide.relanded(side)
    assert moved[0] == "a" and moved[1] == pytest.approx(2.0, abs=0.05)
    assert PrefillSide.relanded(side) == []  # reported once
    del side.books.closing["a"]  # delivered: forgotten
    assert PrefillSide.relanded(side) == [] and "a" not in side.books.landings.reported


def test_a_landing_follows_a_transport_slower_than_its_throttle_and_is_reported_again():
    """The estimate is made at the throttle's rate; the transport then sends at half of it (as when another
    prefill worker's transfers share the decode worker's port): rechecked, the landing has moved later and is
    reported again at the rate measured."""
    import time
    from types import SimpleNamespace

    from pdserve.core.pd.prefill_books import PrefillBooks
    from pdserve.engine.pd import PrefillSide
    from pdserve.transfer.outbox import Chunk, Outbox

    import threading
    gate = threading.Event()

    class Sender:
        sent = 0

        def send_chunk(self, dest, header, pieces) -> bool:
            self.sent += 1
            if self.sent > 1:  # the lane's next send waits here, so what is left stays queued
                gate.wait(10)
            time.sleep(0.1)  # 50 kB in 0.1 s: 0.5 MB/s
            return False

        def position(self, dest):
            return 0

    class Out:
        xfer = rid = "a"
        tier, link, dest, deadline_s, failed, by_copy, num_chunks, last_sent_s = "default", "d0", "d", 1.0, None, False, 0, 0

    box = Outbox(sender=Sender(), policy=DeliveryPolicy("scheduled"), hold=lambda out, ids: None, link_rate=1e6)
    side = SimpleNamespace(outbox=box, books=PrefillBooks(16, 30.0))
    side.books.outbound["a"] = Out()
    try:
        with box.cond:  # queued before the lane may take any
            for _ in range(10):
                box.push(Chunk(side.books.outbound["a"], {}, [], 50_000, [0]))
            assert PrefillSide.landing_in_s(side, "a") == pytest.approx(0.5)  # 500 kB at the throttle's 1 MB/s
        side.books.closing["a"] = side.books.outbound.pop("a")
        deadline = time.monotonic() + 10
        while len(box.lanes["d0"].queue) > 8:  # one chunk sent at half the throttle's rate, the next one taken
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert box.links["d0"].landing_rate(1e6) == pytest.approx(5e5, rel=0.2)
        (moved,) = PrefillSide.relanded(side)
        assert moved[0] == "a" and moved[1] == pytest.approx(0.8, rel=0.2)  # the 8 chunks queued at 0.5 MB/s
    finally:
        gate.set()
        box.stop()


def test_water_level_counts_only_the_tiers_at_or_above_the_best_waiting_one():
    from types import SimpleNamespace as R

    from pdserve.core.pd.delivery import WaterLevel, counted_tiers
    assert counted_tiers([R(service_tier="flex"), R(service_tier="default")]) == {"priority", "default"}
    assert counted_tiers([R(service_tier="priority")]) == {"priority"}
    assert counted_tiers([]) == set()
    water = WaterLevel(0.5)
    assert water.hold_s(100.0, 100.0) == pytest.approx(0.5)
    assert water.hold_s(50.0, 100.0) == 0.0 and WaterLevel(0.0).hold_s(1e9, 1.0) == 0.0


def test_simulated_backpressure_pauses_production_and_loses_nothing():
    """Links far slower than prefill: with a water level the prefill engines pause and cut their chunks
    (counted) and every request still completes; without one they never do."""
    from pdserve.sim.cluster import ClusterSpec, simulate
    from pdserve.sim.hardware import get_gpu, get_model
    from pdserve.sim.timemodel import RooflineTimeModel
    from pdserve.workloads import load_workload

    trace = "fixed:2000,20"
    model, gpu = get_model("llama-3-8b"), get_gpu("h100")
    paused = {}
    for backlog in (0.05, 0.0):
        wl = load_workload(trace, num_requests=12, rate=20.0, seed=1)
        spec = ClusterSpec(mode="pd", num_prefill=1, num_decode=1, link_gbps=1.0, delivery_backlog_s=backlog)
        run = simulate(wl, spec, model, gpu, RooflineTimeModel(model, gpu, 1))
        assert all(r.ok for r in run.records)
        paused[backlog] = run.life.production_paused_s, run.life.production_paced["capped"]
    assert min(paused[0.05]) > 0 and paused[0.0] == (0, 0)  # paused, and chunks cut to the link's headroom


def test_the_consumption_tail_is_learnt_per_tier_once_a_tier_has_samples_of_its_own():
    from pdserve.conductor.consumption import TIER_SAMPLES, ConsumptionPredictor, Prediction
    pred = ConsumptionPredictor(None)

    def transfer(tier: str, wait_s: float) -> Prediction:
        p = Prediction(4, tier=tier)
        pred.at_prefilled(p, 10.0, "decode-0", 0.5)  # lands at 10.5
        pred.consumed(p, "decode-0", 10.5 + wait_s)
        return p

    for _ in range(TIER_SAMPLES - 1):
        transfer("priority", 0.010)
        transfer("flex", 0.200)
    p = Prediction(4, tier="flex")
    pred.at_prefilled(p, 20.0, "decode-0", 0.0)
    # too few of its own: the worker's tails over all tiers, 7 at 10 ms and 7 at 200 ms; the window of +-5 ms
    # holding the most is one of the two clusters (their median, 105 ms, would be within 5 ms of neither)
    assert p.final_s - 20.0 == pytest.approx(0.010) or p.final_s - 20.0 == pytest.approx(0.200)
    transfer("priority", 0.010)
    transfer("flex", 0.200)
    for tier, wait_s in (("priority", 0.010), ("flex", 0.200)):
        p = Prediction(4, tier=tier)
        pred.at_prefilled(p, 20.0, "decode-0", 0.0)
        assert p.final_s == pytest.approx(20.0 + wait_s)


def test_the_tail_taken_is_where_most_recent_tails_fall_within_the_tolerance():
    """A busy decode worker's tails spread over its ~7 ms step; transfers that land on it idle wait 0. With
    about as many idle as busy ones the median (0.75 ms) is within 5 ms of 88% of them; the densest window's centre
    of all of them."""
    from pdserve.conductor.consumption import CONSUME_TOLERANCE_S, densest_centre
    tails = [0.0] * 12 + [0.0005 * i for i in range(1, 15)]  # 0 ms x 12, then 0.5 .. 7 ms
    centre = densest_centre(tails, CONSUME_TOLERANCE_S)

    def within(c: float) -> float:
        return sum(abs(t - c) <= CONSUME_TOLERANCE_S for t in tails) / len(tails)
    assert within(centre) == 1.0 and within(float(np.median(tails))) < 0.9
    assert densest_centre([0.004], CONSUME_TOLERANCE_S) == pytest.approx(0.004)


def test_chunks_shrink_to_a_quantum_of_the_link_while_it_is_congested():
    from pdserve.transfer.outbox import CHUNK_QUANTUM_S, Chunk, Outbox

    class Out:
        link, tier, deadline_s, xfer, failed, by_copy, dest = "decode-0", "default", 1.0, "x", None, False, "d"

    rate, block = 10e6, 4096  # 10 MB/s: a quantum carries 100 KB, 24 blocks of 4 KiB
    box = Outbox(sender=None, policy=DeliveryPolicy("scheduled"), hold=lambda out, ids: None, link_rate=rate)
    assert box.chunk_blocks("decode-0", block, 256) == 256  # nothing queued: as large as the transport allows
    box.push(Chunk(Out(), {}, [], block, [0]))
    assert box.chunk_blocks("decode-0", block, 256) == int(rate * CHUNK_QUANTUM_S) // block
    assert box.chunk_blocks("decode-0", block, 8) == 8  # never above the transport's bound
    assert box.chunk_blocks("decode-0", 10 * rate, 8) == 1  # at least one block
