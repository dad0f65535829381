"""Logprobs (issue 16): every sampled token's and every prompt token's logprob equals a log-softmax of
transformers' fp32 logits for the same sequence; the top alternatives are transformers' top-k; chunked
prefill, a prefix-cache hit and a preemption change nothing."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.errors import InvalidRequestError
from test_model_hf import random_prompts

K = 3


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_logprobs(model, sequence: list[int]) -> torch.Tensor:
    """[len - 1, V]: row i is the distribution of token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_entry(entry, ref_row: torch.Tensor, token: int, k: int) -> None:
    logprob, rank, top = entry
    assert logprob == pytest.approx(ref_row[token].item(), abs=2e-4)
    assert rank == int((ref_row > ref_row[token]).sum()) + 1
    ref_lp, ref_ids = ref_row.topk(k)
    assert [lp for _, lp in top] == pytest.approx(ref_lp.tolist(), abs=2e-4)
    assert {t for t, _ in top} == set(ref_ids.tolist()) or k == 0


@pytest.mark.parametrize("budget", [2048, 8])  # one prefill chunk, and many
def test_sampled_and_prompt_logprobs_match_transformers(tiny_llama_dir, hf_model, budget):
    prompts = random_prompts((5, 17, 40), seed=3)
    llm = LLM(str(tiny_llama_dir), max_num_batched_tokens=budget, block_size=4)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=K, prompt_logprobs=2),
              SamplingParams(temperature=0.9, seed=7, max_tokens=6, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        if p.logprobs is None:
            assert out.logprobs is None and out.prompt_logprobs is None
            continue
        ref = hf_logprobs(hf_model, prompt + out.token_ids)
        assert len(out.logprobs) == len(out.token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert_entry(entry, ref[len(prompt) - 1 + i], token, p.logprobs)
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            assert_entry(out.prompt_logprobs[i], ref[i - 1], prompt[i], p.prompt_logprobs)


def test_a_cached_prompt_still_gets_every_prompt_logprob(tiny_llama_dir):
    prompt = random_prompts((33,), seed=5)[0]
    llm = LLM(str(tiny_llama_dir), block_size=4)
    plain = SamplingParams(temperature=0, max_tokens=2)
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    first = llm.generate([prompt], scored)[0]
    llm.generate([prompt], plain)  # its blocks are cached now
    again = llm.generate([prompt], scored)[0]
    assert again.num_cached_tokens == 0  # computed, not read from the cache: its logits are needed
    assert [e and e[0] for e in again.prompt_logprobs] == pytest.approx([e and e[0] for e in first.prompt_logprobs])


def test_preempted_requests_keep_one_entry_per_token(tiny_llama_dir):
    # a pool too small for all: requests are preempted and recomputed, prompt logprobs with them
    prompts = random_prompts((30, 30, 30, 30), seed=9)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    small = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=40)
    roomy = LLM(str(tiny_llama_dir), block_size=4)
    for a, b in zip(small.generate(prompts, params), roomy.generate(prompts, params)):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == 20 and len(a.prompt_logprobs) == 30
        assert [e[0] for e in a.logprobs] == pytest.approx([e[0] for e in b.logprobs], abs=1e-4)
        assert [e and e[0] for e in a.prompt_logprobs] == pytest.approx([e and e[0] for e in b.prompt_logprobs],
                                                                       abs=1e-4)
    assert small.engine.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_logprobs_out_of_range_are_refused(value):
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match=name):
            SamplingParams(**{name: value})


def test_logprobs_sum_to_one_over_the_vocabulary(tmp_path, default_model_dir):
    # a vocabulary of 16 tokens: the top 16 alternatives are every token, so their probabilities sum to 1
    from conftest import make_tiny_model
    llm = LLM(str(make_tiny_model(tmp_path, default_model_dir, vocab_size=16)))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, logprobs=16, ignore_eos=True))[0]
    for token, (logprob, rank, top) in zip(out.token_ids, out.logprobs):
        assert sorted(t for t, _ in top) == list(range(16))
        assert sum(math.exp(lp) for _, lp in top) == pytest.approx(1.0, abs=1e-5)
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)  # most likely first
        assert rank == 1 and logprob == pytest.approx(top[0][1]) and token == top[0][0]  # greedy: the top one
