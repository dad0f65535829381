"""pdserve.workloads: trace readers, arrival processes, scaling/caps, exact-length prompts, error messages.

Mostly small hand-made files in tmp_path; the real traces in `$PDSERVE_TRACES` (`serve_util.TRACES`) are used
when present.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.errors import InvalidRequestError
from pdserve.workloads import RequestSpec, Workload, block_size, build_prompts, generate_arrivals, load_workload
from serve_util import TRACES


def _mooncake(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"mooncake:{path}"


def _csv(tmp_path: Path, text: str, name: str = "t.csv") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


MC_ROWS = [{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
           {"timestamp": 3000, "input_length": 900, "output_length": 5, "hash_ids": [0, 2]},
           {"timestamp": 1500, "input_length": 20, "output_length": 1, "hash_ids": [3]}]

AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:46.6805900,374,44\n"
         "2023-11-16 18:15:50.9951690,396,109\n"
         "2023-11-16 18:16:46.6805909,10,2000\n")

LENGTHS = ("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
           + "".join(f"{i},{2 * i},{3 * i},0.5\n" for i in range(1, 11)))


# --- readers, scaling, caps --------------------------------------------------------------------------------------

def test_mooncake_arrivals_sorted_and_time_scaled(tmp_path):
    wl = load_workload(_mooncake(tmp_path, MC_ROWS), time_scale=2.0)
    assert [r.arrival_s for r in wl.requests] == [0.0, 0.75, 1.5]
    assert [r.input_len for r in wl.requests] == [1000, 20, 900]
    assert wl.requests[1].hash_ids == (3,)
    assert wl.description["records_read"] == 3 and wl.description["time_scale"] == 2.0
    assert wl.name == "mooncake:mc.jsonl"


def test_length_scale_keeps_hash_ids_and_rounds_to_at_least_one(tmp_path):
    wl = load_workload(_mooncake(tmp_path, MC_ROWS), length_scale=0.1)
    assert [(r.input_len, r.output_len) for r in wl.requests] == [(100, 1), (2, 1), (90, 1)]
    assert wl.requests[0].hash_ids == (0, 1)
    assert block_size(wl) == 51 and block_size(wl, 16) == 2


def test_caps_clip_and_count_and_max_requests_keeps_first_by_arrival(tmp_path):
    wl = load_workload(_mooncake(tmp_path, MC_ROWS), max_input_len=950, max_output_len=6, max_requests=2)
    assert [(r.arrival_s, r.input_len, r.output_len) for r in wl.requests] == [(0.0, 950, 6), (1.5, 20, 1)]
    d = wl.description
    assert (d["clipped_input"], d["clipped_output"], d["records_read"], d["records_kept"]) == (1, 1, 3, 2)


def test_azure_timestamps_parsed_relative_to_first(tmp_path):
    wl = load_workload("azure:" + _csv(tmp_path, AZURE), time_scale=4.0)
    assert [r.arrival_s for r in wl.requests] == pytest.approx([0.0, 4.314579 / 4, 60.0 / 4])
    assert [(r.input_len, r.output_len) for r in wl.requests] == [(374, 44), (396, 109), (10, 2000)]
    assert all(r.hash_ids is None for r in wl.requests)


def test_lengths_seeded_shuffle_with_generated_arrivals(tmp_path):
    spec = "lengths:" + _csv(tmp_path, LENGTHS)
    a = load_workload(spec, rate=10.0, seed=1)
    assert sorted(r.input_len for r in a.requests) == list(range(1, 11))
    assert all(r.output_len == 2 * r.input_len for r in a.requests)
    assert [r.input_len for r in a.requests] != list(range(1, 11))  # shuffled, not file order
    assert a.requests == load_workload(spec, rate=10.0, seed=1).requests
    assert a.requests != load_workload(spec, rate=10.0, seed=2).requests
    assert a.requests[0].arrival_s == 0.0 and a.description["sampling"] == "seeded shuffle"
    more = load_workload(spec, rate=10.0, num_requests=25)
    assert len(more) == 25 and sorted(r.input_len for r in more.requests[:10]) == list(range(1, 11))


def test_fixed_at_time_zero_or_at_rate():
    wl = load_workload("fixed:128,16", num_requests=5)
    assert wl.requests == [RequestSpec(0.0, 128, 16, None)] * 5
    assert wl.description["arrival"] == "all at t=0"
    timed = load_workload("fixed:128,16", num_requests=5, rate=2.0, arrival="gamma", cv=2.0)
    assert timed.requests[0].arrival_s == 0.0 and np.all(np.diff([r.arrival_s for r in timed.requests]) >= 0)
    assert timed.description["cv"] == 2.0 and timed.name == "fixed:128,16"


@pytest.mark.parametrize("arrival,cv", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 2.0)])
def test_interarrival_mean_and_cv(arrival, cv):
    rate = 4.0
    gaps = np.diff(generate_arrivals(5000, rate, np.random.default_rng(123), arrival=arrival, cv=cv))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


# --- prompts ------------------------------------------------------------------------------------------------------

def test_prompts_exact_length_and_range():
    reqs = [RequestSpec(0.0, n, 1, None) for n in (1, 7, 300)]
    reqs += [RequestSpec(0.0, n, 1, h) for n, h in ((5, (0, 1)), (40, (0,)), (33, (0, 1)))]
    prompts = build_prompts(Workload(reqs, "t"), vocab_size=1000, block_tokens=16)
    assert [len(p) for p in prompts] == [1, 7, 300, 5, 40, 33]
    flat = np.concatenate(prompts)
    assert flat.min() >= 100 and flat.max() < 900
    assert all(type(t) is int for t in prompts[0])
    custom = build_prompts(Workload(reqs, "t"), vocab_size=1000, token_range=(5, 8))
    assert set(np.concatenate(custom)) <= {5, 6, 7}


def test_equal_hash_ids_give_equal_blocks_and_different_ones_differ():
    reqs = [RequestSpec(0.0, 48, 1, (7, 8, 9)), RequestSpec(0.0, 40, 1, (7, 8, 10)), RequestSpec(0.0, 16, 1, (11,))]
    a, b, c = build_prompts(Workload(reqs, "t"), vocab_size=32000, block_tokens=16)
    assert a[:32] == b[:32] and a[32:40] != b[32:40]
    assert c != a[:16] and c != a[16:32]
    # Block content depends only on (hash id, seed), not on the position or the request.
    (d,) = build_prompts(Workload([RequestSpec(0.0, 16, 1, (9,))], "t"), vocab_size=32000, block_tokens=16)
    assert d == a[32:48]
    (e,) = build_prompts(Workload([RequestSpec(0.0, 16, 1, (9,))], "t"), vocab_size=32000, block_tokens=16, seed=1)
    assert e != d


def test_hashed_prompt_tail_filled_and_block_scaled_by_length_scale():
    wl = Workload([RequestSpec(0.0, 50, 1, (1, 2)), RequestSpec(0.0, 50, 1, (1, 2))], "t", {"length_scale": 0.5})
    a, b = build_prompts(wl, vocab_size=32000, block_tokens=32)  # block = 16 tokens
    assert len(a) == len(b) == 50
    assert a[:32] == b[:32] and a[32:] != b[32:]  # the fill beyond the hashed blocks is per request
    assert a[:16] != a[16:32]


def test_prompts_without_hash_ids_differ_between_requests():
    wl = load_workload("fixed:64,1", num_requests=50)
    prompts = build_prompts(wl, vocab_size=32000)
    assert len({tuple(p[:4]) for p in prompts}) == 50
    assert prompts == build_prompts(wl, vocab_size=32000)
    assert prompts != build_prompts(wl, vocab_size=32000, seed=3)


# --- errors -------------------------------------------------------------------------------------------------------

def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(InvalidRequestError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_spec_and_option_errors(tmp_path):
    mc = _mooncake(tmp_path, MC_ROWS)
    assert "unknown workload" in _error(load_workload, "sharegpt:x.json")
    assert "unknown workload" in _error(load_workload, "nocolon")
    assert "file path" in _error(load_workload, "azure:")
    assert "No such file" in _error(load_workload, f"mooncake:{tmp_path / 'missing.jsonl'}")
    assert "cannot read" in _error(load_workload, f"azure:{tmp_path}")  # a directory
    assert "need a request rate" in _error(load_workload, "lengths:" + _csv(tmp_path, LENGTHS))
    assert "num_requests" in _error(load_workload, "fixed:10,10")
    assert "IN,OUT" in _error(load_workload, "fixed:10", num_requests=1)
    assert "IN,OUT" in _error(load_workload, "fixed:10,0", num_requests=1)
    assert "time_scale must be a positive" in _error(load_workload, mc, time_scale=0)
    assert "length_scale must be a positive" in _error(load_workload, mc, length_scale=-1.0)
    assert "rate must be a positive" in _error(load_workload, "fixed:1,1", num_requests=1, rate=0.0)
    assert "max_requests" in _error(load_workload, mc, max_requests=0)
    assert "max_input_len" in _error(load_workload, mc, max_input_len=-5)
    assert "seed" in _error(load_workload, mc, seed=-1)
    assert "unknown arrival" in _error(load_workload, "fixed:1,1", num_requests=1, rate=1.0, arrival="uniform")
    assert "needs arrival='gamma'" in _error(load_workload, "fixed:1,1", num_requests=1, rate=1.0, cv=2.0)
    assert "cv must be" in _error(load_workload, "fixed:1,1", num_requests=1, rate=1.0, arrival="gamma", cv=0)
    assert "need a rate" in _error(load_workload, "fixed:1,1", num_requests=1, arrival="gamma")
    assert "rate does not apply" in _error(load_workload, mc, rate=1.0)
    assert "num_requests does not apply" in _error(load_workload, mc, num_requests=3)
    assert "time_scale applies to timestamped" in _error(load_workload, "fixed:1,1", num_requests=1, time_scale=2)


@pytest.mark.parametrize("line,expect", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"timestamp": 0, "input_length": 5}', "missing field(s) output_length"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "timestamp must be"),
    ('{"timestamp": 0, "input_length": "x", "output_length": 1}', "input_length must be a whole number"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "input_length must be >= 1"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, -2]}', "hash_ids must be"),
])
def test_malformed_mooncake_rows_name_the_line(tmp_path, line, expect):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(MC_ROWS[0]) + "\n" + line + "\n")
    msg = _error(load_workload, f"mooncake:{path}")
    assert expect in msg and f"{path}:2" in msg


@pytest.mark.parametrize("scheme,text,expect", [
    ("azure", "", "is empty"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "has no records"),
    ("azure", "time,ContextTokens,GeneratedTokens\nx,1,1\n", "lacks column(s) TIMESTAMP"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16,1,1\n", "TIMESTAMP '2023-11-16'"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,1\n", "wrong number of columns"),
    ("lengths", "num_prefill_tokens,num_decode_tokens\n5,2.5\n", "num_decode_tokens must be a whole number"),
    ("lengths", "num_prefill_tokens\n5\n", "lacks column(s) num_decode_tokens"),
    ("azure", 'TIMESTAMP,ContextTokens,GeneratedTokens\n"' + "x" * 200_000 + '",1,1\n', "not readable as CSV"),
])
def test_malformed_csv_files(tmp_path, scheme, text, expect):
    msg = _error(load_workload, f"{scheme}:{_csv(tmp_path, text)}", rate=1.0 if scheme == "lengths" else None)
    assert expect in msg


def test_prompt_errors():
    wl = Workload([RequestSpec(0.0, 4, 1, None)], "t")
    assert "token range" in _error(build_prompts, wl, vocab_size=150)
    assert "token range" in _error(build_prompts, wl, vocab_size=1000, token_range=(10, 2000))
    assert "seed" in _error(build_prompts, wl, vocab_size=1000, seed=-1)


# --- the real traces ----------------------------------------------------------------------------------------------

REAL = [("mooncake", "mooncake_conversation_trace.jsonl"), ("mooncake", "mooncake_synthetic_trace.jsonl"),
        ("azure", "AzureLLMInferenceTrace_conv_2023.csv"),
        ("lengths", "sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv"),
        ("lengths", "vidur_arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv")]


@pytest.mark.parametrize("scheme,name", REAL)
def test_real_trace_sanity(scheme, name):
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"{path} not present")
    wl = load_workload(f"{scheme}:{path}", max_requests=200, rate=5.0 if scheme == "lengths" else None,
                       length_scale=0.05)
    arrivals = [r.arrival_s for r in wl.requests]
    assert len(wl) == 200 and arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert all(r.input_len >= 1 and r.output_len >= 1 for r in wl.requests)
    if scheme != "mooncake":
        return
    # Check the "first block is shared" claim against the records themselves rather than trusting the README:
    # requests whose first hash id is equal must get the same first block on the wire.
    prompts = build_prompts(wl, vocab_size=32000)
    block = block_size(wl)
    by_first: dict[int, set] = {}
    for req, prompt in zip(wl.requests, prompts):
        assert len(prompt) == req.input_len
        if req.input_len >= block:
            by_first.setdefault(req.hash_ids[0], set()).add(tuple(prompt[:block]))
    assert all(len(blocks) == 1 for blocks in by_first.values())
    first_ids = [r.hash_ids[0] for r in wl.requests]
    if name == "mooncake_conversation_trace.jsonl":  # README: every request starts with block 0
        assert set(first_ids) == {0} and len(by_first[0]) == 1
