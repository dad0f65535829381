"""llama.cpp peer (`llama-cpp-python` on the very GGUF file pdserve embeds): batch-1 greedy generation, or the
logprobs of given token windows (perplexity, top-1 tokens).

Run with the peer's own interpreter (see ../shared/peers/README.md "llama.cpp"), never the project's venv:

    /work/peers/llamacpp/bin/python benchmarks/peers/llamacpp_peer.py --model FILE.gguf --input-len 128 \
        --output-len 128                       # one request: TTFT, TPOT, out tok/s (one JSON line)
    /work/peers/llamacpp/bin/python benchmarks/peers/llamacpp_peer.py --model FILE.gguf --score WINDOWS.json
        # WINDOWS.json: [[token ids], ...]; prints {"logprobs": [[...]], "top1": [[...]]} (one JSON line)

Generation: the same random prompt as pdserve's and the other peers' benchmarks (numpy RandomState(seed), ids
in [10, vocab-10)), greedy (top_k 1), EOS ignored; TTFT is the time to the first token (the prompt's eval),
TPOT the mean time of the rest. `--num-requests N` runs N requests one after another (llama-cpp-python's
`Llama` serves one sequence). Scoring: each window evaluated from its start in one batch (logits_all), the
logprob of each next token and the top-1 token at each position, as pdserve's prompt logprobs.
"""
import argparse
import json
import time

import llama_cpp.llama_cpp as llama_lib
import numpy as np
from llama_cpp import Llama

_default_params = llama_lib.llama_model_default_params


def _no_extra_buffers():
    """Model params without llama.cpp's extra weight buffer types (AMX, repacked Q4): on this Intel Xeon host
    (AMX, 2026-12-07, llama-cpp-python 0.3.36 built with GGML_NATIVE) the AMX matmul segfaults in the first
    decode; `--extra-buffers` keeps them (faster where they work)."""
    params = _default_params()
    params.use_extra_bufts = False
    return params


def generate(args) -> dict:
    n_ctx = max(512, args.input_len + args.output_len + 8)
    llm = Llama(model_path=args.model, n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                n_batch=512, verbose=False)
    rng = np.random.RandomState(args.seed)
    prompts = [rng.randint(10, llm.n_vocab() - 10, size=args.input_len).tolist() for _ in range(args.num_requests)]
    run(llm, prompts[0][:16], 4)  # warmup
    runs = [run(llm, p, args.output_len) for p in prompts]
    elapsed = sum(r["elapsed"] for r in runs)
    return {"engine": "llama.cpp", "num_requests": args.num_requests, "input_len": args.input_len,
            "output_len": args.output_len, "elapsed_s": round(elapsed, 4),
            "output_tok_s": round(sum(len(r["tokens"]) for r in runs) / elapsed, 2),
            "ttft_ms_median": round(float(np.median([r["ttft"] for r in runs])) * 1e3, 3),
            "tpot_ms_median": round(float(np.median([r["tpot"] for r in runs])) * 1e3, 3),
            "token_ids": [runs[0]["tokens"][:8]]}


def run(llm: Llama, prompt: list[int], n: int) -> dict:
    llm.reset()
    tokens, times = [], []
    t0 = time.perf_counter()
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(tok))
        times.append(time.perf_counter())
        if len(tokens) == n:
            break
    return {"tokens": tokens, "elapsed": times[-1] - t0, "ttft": times[0] - t0,
            "tpot": (times[-1] - times[0]) / max(1, len(times) - 1)}


def score(args) -> dict:
    windows = json.loads(open(args.score).read())
    longest = max(len(w) for w in windows)
    llm = Llama(model_path=args.model, n_ctx=longest, n_batch=longest, n_ubatch=longest, logits_all=True,
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    logprobs, top1 = [], []
    for w in windows:
        llm.reset()
        llm.eval(w)
        logits = np.asarray(llm.scores[:len(w) - 1], dtype=np.float64)
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        logprobs.append((logits[np.arange(len(w) - 1), w[1:]] - lse).tolist())
        top1.append(logits.argmax(-1).tolist())
    return {"engine": "llama.cpp", "logprobs": logprobs, "top1": top1}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--num-requests", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--score", default=None, help="a JSON file of token windows: score them instead")
    ap.add_argument("--extra-buffers", action="store_true", help="keep llama.cpp's AMX / repacked weight buffers")
    args = ap.parse_args()
    if not args.extra_buffers:
        llama_lib.llama_model_default_params = _no_extra_buffers
    print(json.dumps(score(args) if args.score else generate(args)), flush=True)


if __name__ == "__main__":
    main()
