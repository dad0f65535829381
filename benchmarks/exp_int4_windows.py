"""Which int4 keys and values to keep exact (issue 16's design experiment): perplexity of the default model on
`--windows` windows of 1,024 tokens of ../shared/texts/gpl-3.0.txt, in this process, int4 with its residual
window switched off and each prefill's attention replaced by one that reads the chosen keys exactly:

    none      every key through the codec (int4 before the residual window)
    sink      position 0 exact (the attention sink)
    block     the query's own block exact (what ships: `pdserve/kv/residual.py`)
    sink+block, win64 (the 64 most recent keys exact), kivi+block (keys coded per channel over each block, in
              the original basis, asymmetric 4-bit with fp16 scale and minimum; the query's own block exact)

int4 rounding is discontinuous, so each variant runs with `--seeds` seeds of a 1e-6 relative perturbation of the
attention output (seed 0: none), and the spread is the answer. One variant and seed per process (the patches
are process-wide):

    cd benchmarks && for v in none sink block sink+block win64 kivi+block; do for s in 0 1 2; do
        ../.venv/bin/python exp_int4_windows.py --variant $v --seed $s; done; done

Prefill only (max_tokens 1): every chunk is a whole window, so the attention here sees the whole prompt."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch

from pdserve.core.kvstore import kv_codecs
from pdserve.model.attention_torch import TorchAttention
from pdserve.model import kernels

BS = 16


def exact_mask(variant: str, n: int) -> torch.Tensor:
    """[n, n]: key j of query i read exactly (the causal mask is applied apart)."""
    pos = torch.arange(n)
    exact = torch.zeros(n, n, dtype=torch.bool)
    if "sink" in variant:
        exact[:, 0] = True
    if "block" in variant:
        exact |= (pos[:, None] // BS) == (pos[None, :] // BS)
    if variant.startswith("win"):
        exact |= (pos[:, None] - pos[None, :]) < int(variant[3:])
    return exact


def kivi_keys(keys: torch.Tensor) -> torch.Tensor:
    """[S, Hkv, D] keys coded per channel over each block of BS tokens and decoded."""
    s, hkv, d = keys.shape
    x = torch.zeros(-(-s // BS) * BS, hkv, d)
    x[:s] = keys
    g = x.view(-1, BS, hkv, d)
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-8).half().float()
    lo = lo.half().float()
    return (torch.round((g - lo) / scale).clamp(0, 15) * scale + lo).view(-1, hkv, d)[:s]


def patch(variant: str, seed: int) -> None:
    """int4 without its window; prefill attention reading the variant's keys exactly."""
    kv_codecs.CODECS["int4"] = dataclasses.replace(kv_codecs.CODECS["int4"], residual=False)
    kernels.usable_coded = lambda codec, *tensors: False  # the torch path: coded and exact k, v side by side
    exact_kv, calls = {}, [0]
    write = TorchAttention.write_kv

    def write_kv(self, qkv, cos, sin, k_cache, v_cache, slot_rows, num_heads, num_kv, codec):
        q, k, v, rows = write(self, qkv, cos, sin, k_cache, v_cache, slot_rows, num_heads, num_kv, codec)
        t, d = qkv.shape[0], codec.head_dim
        exact_kv["k"], exact_kv["v"] = (r.view(num_kv, t, d).transpose(0, 1) for r in rows)
        return q, k, v, rows

    def prefill(self, q, k, v, k_cache, v_cache, meta, chunk, scale, layer, exact):
        assert chunk.kv_rows is None, "a window split into chunks: raise --max-num-batched-tokens"
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        ke, ve = exact_kv["k"][rows], exact_kv["v"][rows]
        kq = kivi_keys(ke) if variant.startswith("kivi") else k
        n, g = q.shape[0], q.shape[1] // k.shape[1]
        exact = exact_mask(variant, n)
        heads = lambda x: x.transpose(0, 1).repeat_interleave(g, 0)  # noqa: E731  [H, S, D]
        qh = q.transpose(0, 1)
        scores = torch.where(exact, qh @ heads(ke).transpose(1, 2), qh @ heads(kq).transpose(1, 2)) * scale
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        p_exact = torch.where(exact, p, torch.zeros_like(p))
        out = (p_exact @ heads(ve) + (p - p_exact) @ heads(v)).transpose(0, 1).reshape(n, -1)
        if seed:
            noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed * 1000 + calls[0]))
            calls[0] += 1
            out = out * (1 + 1e-6 * noise)
        return out

    TorchAttention.write_kv, TorchAttention.prefill = write_kv, prefill  # the backend the kernels hand calls to


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="block", choices=["none", "sink", "block", "sink+block", "win64",
                                                           "kivi+block"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--windows", type=int, default=4)
    args = ap.parse_args()
    from bench_perplexity import TEXT, windows
    from pdserve import LLM, SamplingParams
    from pdserve.model.loader import resolve_model_dir
    from pdserve.tokenizer import Tokenizer
    patch(args.variant, args.seed)
    tokens = Tokenizer.from_dir(resolve_model_dir(None)).encode(TEXT.read_text(), add_special_tokens=False)
    parts = windows(tokens, 1024, args.windows)
    llm = LLM(kv_cache_dtype="int4", max_num_batched_tokens=2048)
    outs = llm.generate(parts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    lps = [e[0] for o in outs for e in o.prompt_logprobs[1:]]
    print(json.dumps({"variant": args.variant, "seed": args.seed, "windows": len(parts),
                      "perplexity": math.exp(-sum(lps) / len(lps))}))


if __name__ == "__main__":
    main()
