"""`usage.kv_transfer` from a decode worker's record of how a prompt's KV arrived (`pdserve.core.pd.kv_arrival`):
delivered or recomputed tokens are those not found cached there, a checkpoint's are counted apart from the
prefix cache's, and several sequences' or prompts' add up with the first recompute reason."""

from __future__ import annotations

from pdserve.core.pd.kv_arrival import DELIVERED, LOCAL, RECOMPUTED, KvArrival, merge


def test_delivered_recomputed_and_local_prompts():
    assert KvArrival(DELIVERED).usage(50, 16) == {"delivered_tokens": 34, "recomputed_tokens": 0,
                                                  "recompute_reason": None, "cached_tokens": 16,
                                                  "checkpoint_tokens": 0}
    assert KvArrival(RECOMPUTED, "failed_checksum").usage(50, 0) == {
        "delivered_tokens": 0, "recomputed_tokens": 50, "recompute_reason": "failed_checksum", "cached_tokens": 0,
        "checkpoint_tokens": 0}
    # computed where it runs by design (colocated, or all but its last token cached): neither
    assert KvArrival(LOCAL).usage(50, 48) == {"delivered_tokens": 0, "recomputed_tokens": 0,
                                              "recompute_reason": None, "cached_tokens": 48, "checkpoint_tokens": 0}


def test_checkpoint_tokens_are_counted_apart_from_the_prefix_cache_and_never_more_than_the_hits():
    assert KvArrival(LOCAL, checkpoint=32).usage(50, 48) == {
        "delivered_tokens": 0, "recomputed_tokens": 0, "recompute_reason": None, "cached_tokens": 16,
        "checkpoint_tokens": 32}
    usage = KvArrival(DELIVERED, checkpoint=64).usage(80, 48)  # (a checkpoint's blocks evicted before use)
    assert usage["checkpoint_tokens"] == 48 and usage["cached_tokens"] == 0 and usage["delivered_tokens"] == 32


def test_several_add_up_with_the_first_reason():
    one = KvArrival(DELIVERED).usage(40, 0)
    two = KvArrival(RECOMPUTED, "failed_send").usage(30, 8)
    three = KvArrival(RECOMPUTED, "failed_timeout").usage(10, 0)
    assert merge([one, two, three]) == {"delivered_tokens": 40, "recomputed_tokens": 32,
                                        "recompute_reason": "failed_send", "cached_tokens": 8,
                                        "checkpoint_tokens": 0}
    assert merge([]) == KvArrival().usage(0, 0)
