"""Routing policies and the per-worker prefix memory they read: plain objects, no processes.

Block hashes here are small ints: the policies only compare them for equality.
"""

from __future__ import annotations

import pytest

from pdserve.conductor.routing import AFFINITY_BLOCKS, LeastLoaded, PrefixAffinity, WorkerLoad
from pdserve.conductor.routing_policies import make_routing_policy

PROMPT = list(range(100, 108))  # the block hashes of an 8-block prompt


def worker(name: str, outstanding: int = 0, seen=(), alive: bool = True) -> WorkerLoad:
    load = WorkerLoad(name, "decode", outstanding=outstanding, alive=alive)
    load.remember(list(seen))
    return load


# ---- WorkerLoad: the remembered prefixes ---------------------------------------------------------------

def test_prefix_blocks_counts_the_leading_run_only():
    load = worker("w", seen=PROMPT[:3] + PROMPT[5:])
    assert load.prefix_blocks(PROMPT) == 3  # blocks 5.. are known, but after a miss the KV chain is broken
    assert load.prefix_blocks([999] + PROMPT) == 0
    assert load.prefix_blocks([]) == 0


def test_only_the_first_affinity_blocks_are_remembered_and_counted():
    long_prompt = list(range(AFFINITY_BLOCKS + 10))
    load = worker("w", seen=long_prompt)
    assert len(load.recent_blocks) == AFFINITY_BLOCKS
    assert AFFINITY_BLOCKS not in load.recent_blocks
    load.remember(long_prompt[AFFINITY_BLOCKS:])  # now every block is known; the count still stops at the window
    assert load.prefix_blocks(long_prompt) == AFFINITY_BLOCKS


def test_memory_is_bounded_and_forgets_the_least_recently_used():
    load = WorkerLoad("w", "decode", max_recent_blocks=4)
    load.remember([1, 2, 3])
    load.remember([1])  # 1 used again: 2 is now the oldest
    load.remember([4, 5])
    assert list(load.recent_blocks) == [3, 1, 4, 5]


# ---- LeastLoaded -----------------------------------------------------------------------------------------

def test_least_loaded_takes_the_fewest_outstanding_and_ignores_prefixes():
    busy_with_prefix = worker("a", outstanding=3, seen=PROMPT)
    idle = worker("b", outstanding=1)
    assert LeastLoaded().pick([busy_with_prefix, idle], PROMPT) is idle


def test_least_loaded_tie_goes_to_the_first_listed():
    a, b = worker("a", 2), worker("b", 2)
    assert LeastLoaded().pick([a, b], PROMPT) is a
    assert LeastLoaded().pick([b, a], PROMPT) is b


# ---- PrefixAffinity --------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra_load,winner", [(1, "cached"), (2, "cached"), (3, "other")])
def test_a_whole_prompt_match_is_worth_two_outstanding_requests(extra_load, winner):
    """Score = outstanding - 2 x matched fraction: at 2 more requests the scores tie and the first listed
    (the cached worker) wins; at 3 more the load outweighs the cache."""
    cached = worker("cached", outstanding=1 + extra_load, seen=PROMPT)
    other = worker("other", outstanding=1)
    assert PrefixAffinity().pick([cached, other], PROMPT).name == winner


def test_the_bonus_is_proportional_to_the_matched_fraction():
    half = worker("half", outstanding=2, seen=PROMPT[:4])  # 2 - 2 x 4/8 = 1
    none = worker("none", outstanding=1)  # 1: a tie, the first listed wins
    assert PrefixAffinity().pick([half, none], PROMPT) is half
    assert PrefixAffinity().pick([none, half], PROMPT) is none
    most = worker("most", outstanding=2, seen=PROMPT[:6])  # 2 - 2 x 6/8 = 0.5: beats both
    assert PrefixAffinity().pick([none, half, most], PROMPT) is most


def test_the_weight_sets_what_a_match_is_worth():
    cached, other = worker("cached", outstanding=5, seen=PROMPT), worker("other", outstanding=1)
    assert PrefixAffinity(weight=2.0).pick([cached, other], PROMPT) is other
    assert PrefixAffinity(weight=5.0).pick([cached, other], PROMPT) is cached


def test_a_prompt_longer_than_the_affinity_window_matches_whole_on_its_first_blocks():
    """The matched fraction is over the first AFFINITY_BLOCKS blocks, not over the whole prompt."""
    long_prompt = list(range(3 * AFFINITY_BLOCKS))
    cached = worker("cached", outstanding=2, seen=long_prompt)  # knows all it can: 2 - 2 = 0
    other = worker("other", outstanding=1)
    assert PrefixAffinity().pick([other, cached], long_prompt) is cached


def test_without_block_hashes_prefix_affinity_is_least_loaded():
    """A prompt shorter than one block has no hashes: no bonus for anyone, and no division by zero."""
    a, b = worker("a", 2, seen=PROMPT), worker("b", 1)
    assert PrefixAffinity().pick([a, b], []) is b


# ---- both policies ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", [LeastLoaded(), PrefixAffinity()], ids=["least-loaded", "prefix-affinity"])
def test_dead_workers_are_never_picked(policy):
    dead = worker("dead", outstanding=0, seen=PROMPT, alive=False)  # idle and cached, but dead
    live = worker("live", outstanding=7)
    assert policy.pick([dead, live], PROMPT) is live
    assert policy.pick([dead], PROMPT) is None
    assert policy.pick([], PROMPT) is None


def test_policies_by_name():
    assert isinstance(make_routing_policy("least-loaded"), LeastLoaded)
    assert isinstance(make_routing_policy("prefix-affinity"), PrefixAffinity)
    with pytest.raises(ValueError, match="least-loaded.*prefix-affinity"):
        make_routing_policy("round-robin")


def test_resending_the_same_prefix_keeps_the_memory_bounded():
    load = WorkerLoad("w", "decode", max_recent_blocks=64)
    hashes = list(range(1, 33))
    for _ in range(2000):  # a hot system prompt routed here again and again
        load.remember(hashes)
    assert len(load.recent_blocks) == 32 and load.prefix_blocks(hashes) == 32
    assert sum(len(keys) for keys, _ in load.recent_blocks._runs) <= 2 * 32 + AFFINITY_BLOCKS
    load.remember([100, 101])
    assert list(load.recent_blocks) == hashes + [100, 101]


def test_the_shared_pool_counts_as_a_tier_every_worker_reaches():
    """A worker's `kv_cache` report of what it wrote to the shared pool (`remote`) goes to the pool all workers
    read (`Books.pool`): prefix affinity then credits every worker `POOL_CREDIT` of each pooled block it lacks,
    so the less loaded worker that can read the prefix from the pool beats a busier one that holds it."""
    from pdserve.conductor.conductor_core import ConductorCore
    from pdserve.conductor.routing import POOL_CREDIT
    core = ConductorCore("colocated", make_routing_policy("prefix-affinity"))
    for name in ("c0", "c1"):
        core.add_worker(name, "colocated")
    hashes = core.books.affinity(list(range(16 * 8 + 1)))  # an 8-block prompt's block hashes (block 16)
    busy, idle = core.workers["c0"], core.workers["c1"]
    core.worker_cache("c0", {"device": list(hashes)}, {})  # c0 holds the prefix ...
    busy.outstanding = 1  # ... and has a request
    assert PrefixAffinity().pick([busy, idle], hashes) is busy  # no pool: its cache is worth 2 requests
    core.worker_cache("c0", {"remote": list(hashes)}, {})  # c0 wrote it to the pool
    assert idle.reach_blocks(hashes) == POOL_CREDIT * len(hashes) and busy.reach_blocks(hashes) == len(hashes)
    assert PrefixAffinity().pick([busy, idle], hashes) is idle
    assert "remote" not in busy.reported.held  # (the pool is no worker's own tier)
