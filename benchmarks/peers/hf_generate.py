"""HF transformers peer: greedy `generate` of random-token prompts as one batch (the simple baseline).

Run with the HF peer's own interpreter (see ../shared/peers/README.md), never the project's venv:

    /work/peers/hf/bin/python benchmarks/peers/hf_generate.py --model DIR --num-requests 16 \
        --input-len 128 --output-len 128

Prompts are the same as pdserve's and vLLM's benchmark (numpy RandomState(seed), ids in [10, vocab-10)),
all of one length, so the batch needs no padding. TTFT is the time of a `max_new_tokens=1` generate of the
same batch; TPOT = (full time - TTFT) / (output_len - 1). Prints one JSON line.
"""
import argparse
import json
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rng = np.random.RandomState(args.seed)
    ids = torch.tensor(np.stack([rng.randint(10, model.config.vocab_size - 10, size=args.input_len)
                                 for _ in range(args.num_requests)]))

    def gen(n):
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        return out[:, args.input_len:], time.perf_counter() - t0

    gen(2)  # warmup
    _, ttft = gen(1)
    out, elapsed = gen(args.output_len)
    print(json.dumps({
        "engine": "hf-transformers", "num_requests": args.num_requests, "input_len": args.input_len,
        "output_len": args.output_len, "elapsed_s": round(elapsed, 4),
        "output_tok_s": round(out.numel() / elapsed, 2), "ttft_ms_median": round(ttft * 1e3, 3),
        "tpot_ms_median": round((elapsed - ttft) * 1e3 / (args.output_len - 1), 3),
        "token_ids": [out[0, :8].tolist()]}), flush=True)


if __name__ == "__main__":
    main()
