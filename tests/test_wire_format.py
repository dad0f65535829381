"""The format a transfer travels in (`pdserve.core.pd.wire_format`): fixed, or chosen by class and link."""

import pytest

from pdserve.core.pd.wire_format import COMPACT, LinkView, WireFormat, check_wire_dtype, tiers_ahead
from pdserve.errors import InvalidRequestError

POOL_FMT = "float32"
RATIO = 68 / 256  # int8 records per float32 byte (head size 64)
MB = 1e6


def choose(mode, tier="default", own=10 * MB, queued=0.0, rate=10 * MB, consume_in_s=5.0, ratio=RATIO):
    return WireFormat(mode).choose(tier, POOL_FMT, own, LinkView(queued, rate), consume_in_s, ratio)


def test_pool_and_fixed_formats_ignore_class_and_link():
    assert choose("pool", queued=1e12) == POOL_FMT
    assert choose("fp8_e4m3") == "fp8_e4m3" and choose("int8", tier="priority") == "int8"


def test_auto_ships_elastic_kv_compact_only_when_the_link_would_miss_its_consumption():
    # 10 MB of its own at 10 MB/s: 1 s; consumed in 5 s
    assert choose("auto", queued=30 * MB) == POOL_FMT  # 4 s exact: in time
    assert choose("auto", queued=41 * MB) == COMPACT  # 5.1 s exact: late
    assert choose("auto", tier="flex", queued=41 * MB) == COMPACT


def test_auto_keeps_the_guaranteed_tier_exact_and_needs_a_prediction_and_a_rate():
    assert choose("auto", tier="priority", queued=1e12) == POOL_FMT
    assert choose("auto", queued=1e12, consume_in_s=None) == POOL_FMT
    assert choose("auto", queued=1e12, rate=None) == POOL_FMT
    assert choose("auto", queued=1e12, ratio=1.0) == POOL_FMT  # a pool already as compact: nothing gained


def test_what_goes_ahead_of_a_tier_on_its_link():
    assert tiers_ahead("priority") == {"priority"}
    assert tiers_ahead("flex") == {"priority", "default", "flex"}


def test_an_unknown_wire_format_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match="fp4.*pool, auto.*int8"):
        check_wire_dtype("fp4")
    with pytest.raises(InvalidRequestError):
        WireFormat("float32")  # the pool's own format is `pool`
