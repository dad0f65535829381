"""SamplingParams validation: bad values raise InvalidRequestError naming the parameter."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError, PdserveError


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(max_tokens="16"), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=None), "max_tokens"),
    (dict(temperature=-0.01), "temperature"),
    (dict(temperature=2.01), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_p=1.0001), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_k="5"), "top_k"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=[1]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_values(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert e.value.status_code == 400 and e.value.error_type == "invalid_request_error"
    assert param in str(e.value)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(max_tokens=1),
    dict(temperature=0), dict(temperature=0.0), dict(temperature=2), dict(temperature=1.3),
    dict(top_p=1.0), dict(top_p=1e-6), dict(top_p=0.5),
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_k=50),
    dict(stop=["a", "bc"]), dict(stop=()),
    dict(stop_token_ids=[0, 7]),
    dict(seed=123, ignore_eos=True, include_stop_str_in_output=True),
])
def test_valid_values(kwargs):
    sp = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        if k not in ("stop", "stop_token_ids"):
            assert getattr(sp, k) == v


def test_defaults():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (1.0, 1.0, 0, 16)
    assert sp.stop == () and sp.stop_token_ids == () and not sp.greedy


def test_stop_string_becomes_tuple():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop="xyz").stop == ("xyz",)  # not split into characters
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_frozen_and_hashable():
    sp = SamplingParams(stop=["a"], stop_token_ids=[1])
    assert hash(sp) == hash(SamplingParams(stop=("a",), stop_token_ids=(1,)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.max_tokens = 3  # type: ignore[misc]


def test_greedy():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.1).greedy


@pytest.mark.parametrize("kwargs,param,message", [
    (dict(stop=5), "stop", "stop must be a string or a list of non-empty strings"),
    (dict(stop_token_ids=["a"]), "stop_token_ids", "stop_token_ids must be a list of non-negative integers"),
    (dict(temperature=None), "temperature", "temperature must be a number, got None"),
    (dict(temperature="hot"), "temperature", "temperature must be a number, got 'hot'"),
    (dict(top_p=None), "top_p", "top_p must be a number, got None")])
def test_malformed_types_raise_invalid_request_error(kwargs, param, message):
    with pytest.raises(PdserveError) as e:
        SamplingParams(**kwargs)
    assert type(e.value) is InvalidRequestError and e.value.status_code == 400
    assert e.value.param == param and e.value.message == message


def test_none_for_a_list_means_an_empty_one():
    assert SamplingParams(stop=None).stop == () and SamplingParams(stop_token_ids=None).stop_token_ids == ()
