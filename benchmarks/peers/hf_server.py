"""Naive baseline: an OpenAI-compatible server around Hugging Face transformers `generate`.

This is what one gets without a serving engine, the floor that pdserve and vLLM are compared against:
STATIC batching (a background thread takes every waiting request, up to --max-batch, left-pads them into one
`generate` call, and requests that arrive meanwhile wait until that whole batch is done: no continuous
batching) and a dense per-batch KV cache (no paged KV, no prefix sharing, no chunked prefill). fp32, torch
threads = all cores.

Run with the HF peer's interpreter (see README.md here and ../shared/peers/README.md), never pdserve's venv:

    /work/peers/hf/bin/pip install fastapi uvicorn   # once
    /work/peers/hf/bin/python benchmarks/peers/hf_server.py --model /work/peers/smollm2-hf --port 8002

API: GET /v1/models; POST /v1/completions with `prompt` (a string or a list of token ids), `max_tokens`,
`temperature` (0 = greedy), `ignore_eos` (vLLM's extension), `stream` (SSE, one chunk per token, a `usage`
chunk when `stream_options.include_usage`, then `data: [DONE]`). Each request of a batch stops at its own
max_tokens or EOS; the batch runs for its longest request. A per-step hook (a StoppingCriteria, which
`generate` calls after every new token) streams each row's token and marks the row finished.
"""
import argparse
import asyncio
import json
import os
import queue
import threading
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList, \
    StoppingCriteria, StoppingCriteriaList


class Req:
    def __init__(self, ids, max_tokens, temperature, ignore_eos, loop):
        self.ids, self.max_tokens, self.temperature, self.ignore_eos = ids, max_tokens, temperature, ignore_eos
        self.loop, self.events = loop, asyncio.Queue()
        self.out, self.text, self.finish, self.cancelled = [], "", None, False

    def send(self, event):  # called from the generate thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class PerRowTemperature(LogitsProcessor):
    """Greedy rows become one-hot (so sampling picks their argmax); sampled rows are divided by temperature."""

    def __init__(self, temps):
        self.temps = temps

    def __call__(self, input_ids, scores):
        greedy = self.temps <= 0
        scores = scores / torch.where(greedy, 1.0, self.temps)[:, None]
        if greedy.any():
            onehot = torch.full_like(scores, float("-inf"))
            onehot.scatter_(1, scores.argmax(-1, keepdim=True), 0.0)
            scores = torch.where(greedy[:, None], onehot, scores)
        return scores


class StreamRows(StoppingCriteria):
    """Called by `generate` after every step: hands each live row its new token, returns which rows are done."""

    def __init__(self, reqs, tok, eos_id):
        self.reqs, self.tok, self.eos_id = reqs, tok, eos_id
        self.done = torch.zeros(len(reqs), dtype=torch.bool)

    def __call__(self, input_ids, scores, **kwargs):
        for i, (r, t) in enumerate(zip(self.reqs, input_ids[:, -1].tolist())):
            if self.done[i]:
                continue
            r.out.append(t)
            if t == self.eos_id and not r.ignore_eos:
                r.finish = "stop"
            elif len(r.out) >= r.max_tokens or r.cancelled:
                r.finish = "length"
            self.done[i] = r.finish is not None
            text = self.tok.decode(r.out, skip_special_tokens=True)
            if text.endswith("\ufffd") and r.finish is None:  # an incomplete UTF-8 character: wait for more
                delta = ""
            else:
                delta, r.text = text[len(r.text):], text
            r.send((delta, r.finish))
        return self.done.clone()


def batch_loop(model, tok, waiting, max_batch):
    eos_id, pad_id = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    while True:
        reqs = [waiting.get()]
        while len(reqs) < max_batch:
            try:
                reqs.append(waiting.get_nowait())
            except queue.Empty:
                break
        width = max(len(r.ids) for r in reqs)
        ids = torch.tensor([[pad_id] * (width - len(r.ids)) + r.ids for r in reqs])
        mask = torch.tensor([[0] * (width - len(r.ids)) + [1] * len(r.ids) for r in reqs])
        temps = torch.tensor([float(r.temperature) for r in reqs])
        # sample only when a row asks for it, from the full distribution (PerRowTemperature does the rest)
        sample = {"do_sample": False}
        if (temps > 0).any():
            sample = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
        try:
            with torch.inference_mode():
                model.generate(ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in reqs),
                               pad_token_id=pad_id, logits_processor=LogitsProcessorList([PerRowTemperature(temps)]),
                               stopping_criteria=StoppingCriteriaList([StreamRows(reqs, tok, eos_id)]),
                               **sample)
        except Exception as e:  # noqa: BLE001 - report to every request of the batch, keep serving
            for r in reqs:
                r.send((None, f"{type(e).__name__}: {e}"))


def make_app(model, tok, name, max_len, waiting):
    app = FastAPI()

    def error(status, message):
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}}, status)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "hf-transformers", "max_model_len": max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("model") not in (None, name):
            return error(404, f"model {body.get('model')!r} does not exist; this server has {name!r}")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str):
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < len(tok) for t in prompt):
            ids = prompt
        else:
            return error(400, "prompt must be a string or a list of token ids (one prompt per request)")
        max_tokens = int(body.get("max_tokens") or 16)
        if not ids or max_tokens < 1 or len(ids) + max_tokens > max_len:
            return error(400, f"need a non-empty prompt, max_tokens >= 1 and prompt + max_tokens <= {max_len}")
        temperature = body.get("temperature")
        r = Req(ids, max_tokens, 1.0 if temperature is None else float(temperature), bool(body.get("ignore_eos")),
                asyncio.get_running_loop())
        waiting.put(r)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": len(r.out),  # noqa: E731
                         "total_tokens": len(ids) + len(r.out)}
        chunk = lambda choices, **kw: {"id": rid, "object": "text_completion", "created": created,  # noqa: E731
                                       "model": name, "choices": choices, **kw}

        if not body.get("stream"):  # events are (text delta, finish reason or None), or (None, error)
            while (ev := await r.events.get())[0] is not None and ev[1] is None:
                pass
            if ev[0] is None:
                return error(500, ev[1])
            return chunk([{"index": 0, "text": r.text, "logprobs": None, "finish_reason": ev[1]}], usage=usage())

        async def sse():
            try:
                while True:
                    text, finish = await r.events.get()
                    if text is None:
                        yield f"data: {json.dumps({'error': {'message': finish, 'code': 500}})}\n\n"
                        break
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                    yield f"data: {json.dumps(chunk([choice]))}\n\n"
                    if finish is not None:
                        if (body.get("stream_options") or {}).get("include_usage"):
                            yield f"data: {json.dumps(chunk([], usage=usage()))}\n\n"
                        break
                yield "data: [DONE]\n\n"
            finally:
                r.cancelled = True  # a client that went away stops its row at the next step

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/peers/smollm2-hf", help="Hugging Face model directory")
    ap.add_argument("--served-model-name", default="SmolLM2-135M-Instruct")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8002)
    ap.add_argument("--max-batch", type=int, default=16, help="most requests in one generate call")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="torch threads; default: all cores (use 1 when other processes keep the cores busy)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS is handled per row by StreamRows (ignore_eos)
    with torch.inference_mode():  # warm-up, so that the first request's TTFT is not the first call's
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    waiting = queue.Queue()
    threading.Thread(target=batch_loop, args=(model, tok, waiting, args.max_batch), daemon=True).start()
    max_len = getattr(model.config, "max_position_embeddings", 2048)
    print(f"hf_server: {args.model} loaded in {time.perf_counter() - t0:.1f} s, {args.threads} threads, "
          f"static batches of <= {args.max_batch}; http://{args.host}:{args.port}", flush=True)
    uvicorn.run(make_app(model, tok, args.served_model_name, max_len, waiting), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
