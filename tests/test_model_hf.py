"""Token-exact greedy equality with Hugging Face transformers on the same weights.

Each scenario runs our engine over a batch of prompts of different lengths and compares every request's
tokens with transformers' `generate` run on that prompt alone.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_no_blocks_held, make_tiny_model
from pdserve import LLM, SamplingParams

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def hf_greedy(model_dir, prompts: list[list[int]], new_tokens: int = NEW_TOKENS, gguf_file=None,
              stop_at_eos: bool = False):
    """transformers' greedy tokens. Without `stop_at_eos` EOS is an ordinary token, as with our
    `ignore_eos=True` (transformers' `min_new_tokens` would instead forbid EOS, changing the argmax)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=gguf_file, dtype=torch.float32).eval()
    if not stop_at_eos:
        model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        outs.append(ids[0, len(p):].tolist())
    return outs


def random_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 49000, (n,), generator=g).tolist() for n in lengths]


def assert_same(outputs, references):
    for i, (out, ref) in enumerate(zip(outputs, references, strict=True)):
        assert out.token_ids == ref, f"request {i} diverged from transformers"


@pytest.fixture(scope="module")
def tiny_case(tiny_llama_dir):
    prompts = random_prompts((5, 17, 33, 64, 3))
    return tiny_llama_dir, prompts, hf_greedy(tiny_llama_dir, prompts)


def test_batch_of_different_lengths(tiny_case):
    model_dir, prompts, refs = tiny_case
    assert_same(LLM(str(model_dir)).generate(prompts, GREEDY), refs)


def test_chunked_prefill_with_tiny_budget(tiny_case):
    model_dir, prompts, refs = tiny_case
    llm = LLM(str(model_dir), max_num_batched_tokens=8, block_size=4)
    assert_same(llm.generate(prompts, GREEDY), refs)


def test_preemption_when_pool_is_too_small(tiny_case):
    model_dir, prompts, refs = tiny_case
    llm = LLM(str(model_dir), num_kv_blocks=30, block_size=4)  # 120 tokens for ~240 needed
    assert_same(llm.generate(prompts, GREEDY), refs)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert_no_blocks_held(llm.engine)


def test_prefix_cache_shared_prefix_and_second_turn(tiny_llama_dir):
    shared = random_prompts((40,), seed=1)[0]
    tails = random_prompts((3, 9, 1), seed=2)
    prompts = [shared + t for t in tails]
    refs = hf_greedy(tiny_llama_dir, prompts)
    llm = LLM(str(tiny_llama_dir), block_size=4)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    assert_same(first + rest, refs)
    stats = llm.engine.scheduler.stats
    assert stats.num_prefix_hit_tokens >= 2 * 40 - 8  # the later two reused (almost) all of the prefix
    # Second turn of a conversation: prompt + answer + a new user turn hits the first turn's blocks.
    turn2 = prompts[0] + first[0].token_ids + random_prompts((6,), seed=3)[0]
    hits_before = stats.num_prefix_hit_tokens
    out = llm.generate([turn2], GREEDY)
    assert stats.num_prefix_hit_tokens - hits_before >= len(prompts[0]) + NEW_TOKENS - 8
    assert_same(out, hf_greedy(tiny_llama_dir, [turn2]))


def test_prefix_cache_hit_with_chunking_and_preemption(tiny_case):
    model_dir, prompts, refs = tiny_case
    llm = LLM(str(model_dir), num_kv_blocks=40, block_size=4, max_num_batched_tokens=16)
    assert_same(llm.generate(prompts, GREEDY), refs)
    assert_same(llm.generate(prompts, GREEDY), refs)  # now mostly from the prefix cache
    assert llm.engine.scheduler.stats.num_prefix_hit_tokens > 0


@pytest.mark.parametrize("arch,overrides", [
    ("qwen2", {}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                   "rope_theta": 500000.0}, "tie_word_embeddings": False}),
    ("llama", {"num_key_value_heads": 4, "attention_bias": True}),
])
def test_other_family_variants(tmp_path, default_model_dir, arch, overrides):
    model_dir = make_tiny_model(tmp_path, default_model_dir, arch=arch, seed=5, **overrides)
    prompts = random_prompts((7, 50, 20), seed=4)
    refs = hf_greedy(model_dir, prompts)
    assert_same(LLM(str(model_dir), max_num_batched_tokens=16, block_size=8).generate(prompts, GREEDY), refs)


def test_seeded_sampling_is_independent_of_batch(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=7, ignore_eos=True)
    prompt = random_prompts((12,), seed=9)[0]
    alone = llm.generate([prompt], params)[0].token_ids
    others = random_prompts((5, 30), seed=10)
    batched = llm.generate([others[0], prompt, others[1]],
                           [SamplingParams(temperature=1.0, max_tokens=16), params, GREEDY])[1].token_ids
    assert alone == batched
    different_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=8, ignore_eos=True)
    assert llm.generate([prompt], different_seed)[0].token_ids != alone
    # resumed elsewhere from prompt + the first outputs (a request moved off a dead worker): the same stream
    resume = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=11, seed=7, ignore_eos=True)
    assert llm.generate([prompt + alone[:5]], resume)[0].token_ids == alone[5:]


def test_default_model_matches_transformers_gguf(default_model_dir):
    """Our GGUF conversion + runtime vs transformers' own GGUF dequantization, on real text."""
    from pdserve.model.loader import default_model_path
    gguf = default_model_path()
    llm = LLM(max_num_batched_tokens=32)
    texts = ["The capital of France is", "def fibonacci(n):",
             "Water boils at a temperature of 100 degrees Celsius, which is", "Hi"]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    prompts.append(llm.tokenizer.encode_chat([{"role": "user", "content": "Name three fruits."}]))
    refs = hf_greedy(str(gguf.parent), prompts, gguf_file=gguf.name, stop_at_eos=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert_same(outs, refs)
    assert outs[-1].finish_reason == "stop"  # the chat answer ends with <|im_end|> within the budget
