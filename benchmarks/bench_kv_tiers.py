"""KV tiers (device, host, disk) measured on the running system (issue 12, "How it must be shown").

    .venv/bin/python benchmarks/bench_kv_tiers.py [--parts ttft,hits,context,bandwidth] [--modes colocated[,pd]]
        [--window 600] [--select conversations|first] [--length-scale 0.015625] [--time-scale 1]
        [--device-fraction 0.25] [--host-fraction 0.5] [--disk-fraction 2] [--quick]

    smoke run (a minute or two per part):  .venv/bin/python benchmarks/bench_kv_tiers.py --quick

Expected run time of the defaults on 2 cores: serving ~8 min per mode (two replays of ~200 s plus starts),
context ~10 min (prefills of 4k-8k-token prompts run at ~120-130 tokens/s here, on both the tiered and the
reference engine), bandwidth ~1 min.

Prints the host CPU and one table per part, and writes every number to bench_results/kv_tiers.json (with
--quick: bench_results/kv_tiers_quick.json) with the CPU model (lscpu "Model name"), the flags and the date.
Running some parts only updates those parts' entries of an existing file. Servers log to
bench_results/kv_tiers[_quick]/<mode>-<config>/server.log next to `pdserve bench serve`'s result.json.

ttft + hits (one replay per server; two servers, started one after the other, never together):
  Workload: the Mooncake conversation trace ($PDSERVE_TRACES, else ../shared/traces beside the repository,
  else /work/shared/traces). Its later turns come ~150 s (median) after the turn they extend, so the first
  120 requests hold no later turn at all (the first is request 133); the first 600 (201 s of trace) hold 101.
  `--select conversations` (default) therefore keeps, of the first `--window` requests, the later turns (a
  request whose leading hash_ids share more than block 0, the system prefix every request starts with, with
  an earlier request) and every request they extend, transitively (W=600: 186 requests, 101 later turns), plus
  every `--singles-every`-th other request as background traffic (0 = none); `--select first` keeps the first
  `--window` requests as they are. The kept records are written unchanged (timestamps rebased to the first
  one) to selected_trace.jsonl and replayed open loop with `pdserve bench serve --workload mooncake:FILE
  --length-scale L --time-scale T` (default L = 1/64: a hash block is 8 tokens, the longest prompt 1,895;
  ~43k prompt tokens, ~200 s of arrivals at T = 1). "Later turn" is decided over the replayed requests.
  Configs, same device pool (--num-kv-blocks = --device-fraction x the replay's distinct full 16-token KV
  blocks, at least 2x the longest request; --quick: first 250, 26 requests, T = 2):
    device: --kv-host-gb 0 (device pool only);
    tiers:  + --kv-host-gb (--host-fraction x those blocks, at least the pool + the longest request:
              smaller than the working set, larger than the pool it copies)
            + --kv-disk-dir <tmp> --kv-disk-gb (--disk-fraction x: the rest fits on disk).
  Reported per mode and config: median / p90 TTFT of later turns and of all requests (from result.json's
  per-request timelines, workload order), median TPOT of all requests (a check that the tiers' background
  copies do not slow decoding), failed requests, and the ratio device / tiers.
  Mode: colocated by default (one worker, both cores): there the one worker both computes prompts and holds
  the tiers, so a tier hit is compute saved on the TTFT path. In PD mode (`--modes pd`, 1 prefill + 1 decode,
  one core each) TTFT hits are the prefill worker's; the decode worker's hits only shorten the KV delivery
  (shm, a copy).
  hits: after each replay, from /metrics (counter deltas over the replay, warmup excluded):
  pdserve_prefix_cache_hit_tokens_total{worker,tier} / pdserve_prefix_cache_query_tokens_total{worker} on
  the worker that computes prompts (colocated: its one worker; PD: the prefill worker, decode shown too),
  and / the replay's prompt tokens, against (a) the README's infinite-cache bound over the same scaled
  requests, sum min(b*k, input_len) / sum input_len with b = round(512 * L) tokens per hash block
  (pdserve.workloads.block_size) and k = leading hash_ids already seen, and (b) the same bound at the KV
  cache's granularity, from the exact prompts `bench serve` sends (build_prompts, seed 0): leading full
  16-token blocks already in some earlier prompt, at most (len - 1) tokens (the last prompt token is always
  computed). Also bytes in/out per tier and blocks per tier at the end.

context (in-process, pdserve.LLM, greedy, ignore_eos):
  Pool of --context-pool-blocks (64) x 16 tokens = 1,024. Device only (kv_host_gb=0): a prompt of
  1,024 - out tokens runs; 1,024 and 2,048 are rejected with context_length_exceeded (shown). With a host
  tier (1 GiB) and the default hot window (4,096 tokens, capped at half the pool): prompts of 4x, 6x, 8x the
  pool minus out (8x = the model's 8,192 limit), each compared token for token with a big-pool device-only
  reference (every multiple; --quick: 4x only). Each LLM first runs one short untimed request.
  TPOT penalty: for a context 4x the pool, decode time per output token ((last token - first token) /
  (n - 1), n = --context-out-tokens, 32) with tiers (cold blocks read from host every step, torch attention
  path) vs the big pool (device only), --context-repeats distinct prompts (3; the first is the 4x prompt
  above) on both, in the same process, medians. TTFT of each is printed too (prefill of the long prompt).

bandwidth (in-process, pdserve.kv.tier_io.TierIO on the default model's KV shape: 30 layers, 3 KV heads,
  head_dim 64, fp32, block 16 = 737,280 bytes per block; --io-blocks blocks (1,024 = 755 MB) moved in
  ops of --io-batch-blocks (128, one 2,048-token prefill step's blocks); an untimed pass first touches all
  memory, then --io-repeats timed passes, median; GB/s = payload bytes moved once / wall time):
    offload  device pool -> host slots (TierIO's background thread, `submit` + `drain`);
    load     host slots -> device pool (`TierIO.load`, on the caller's thread, as the engine does);
    flush    host slots -> one file per block in a fresh tmp dir (header + xxh3-64 + rename; no fsync:
             the page cache absorbs it);
    prefetch files -> host slots, verified (header + xxh3-64), warm (files in the page cache) and cold
             (page cache dropped: `echo 3 > /proc/sys/vm/drop_caches` when allowed, else fsync +
             posix_fadvise(DONTNEED) per file; the method is recorded; drop_caches empties the whole
             machine's page cache, mind other jobs); bytes checked equal to the source after offload and
             after each prefetch.
  Ceilings, same run, same total size: memcpy (torch copy_ of one region into another, one call; and the
  same walked in block-sized pieces), sequential file write (plain Python, block-sized writes to one file;
  without and with fsync), sequential read (warm, cold), plus the per-file pattern alone (one plain file
  per block, write / read, no checksum) and xxh3-64 over the region. Each op is also given as a fraction
  of its ceiling: offload, load / memcpy; flush / write without fsync; prefetch / read (warm / cold).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from serve_proc import PDSERVE, Server  # noqa: E402 - beside this script

ROOT = Path(__file__).resolve().parents[1]
_BESIDE = ROOT.parent / "shared" / "traces"
TRACES = Path(os.environ.get("PDSERVE_TRACES") or (_BESIDE if _BESIDE.is_dir() else "/work/shared/traces"))
TRACE = TRACES / "mooncake_conversation_trace.jsonl"
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
BLOCK_BYTES = LAYERS * 2 * KV_HEADS * BLOCK * HEAD_DIM * 4  # 737,280: one fp32 block of the default model
GB = 1e9


# ---------------------------------------------------------------------------------------------- helpers
def host_cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def by_labels(metrics: dict, name: str, *keys: str) -> dict[tuple, float]:
    """{(label values of `keys`): sum of the samples of `name`}."""
    out: dict[tuple, float] = {}
    for (n, labels), v in metrics.items():
        if n == name:
            d = dict(labels)
            k = tuple(d.get(key, "") for key in keys)
            out[k] = out.get(k, 0.0) + v
    return out


# ------------------------------------------------------------------------------------ trace selection
def leading_seen(hash_ids: list[int], seen: set) -> int:
    k = 0
    for h in hash_ids:
        if h not in seen:
            break
        k += 1
    return k


def select_trace(window: int, select: str, singles_every: int) -> list[dict]:
    records = [json.loads(line) for line in TRACE.open() if line.strip()][:window]
    if select == "first":
        return records
    seen: set = set()
    owner: dict[int, int] = {}
    parents: dict[int, set[int]] = {}
    for i, r in enumerate(records):
        k = leading_seen(r["hash_ids"], seen)
        if k > 1:  # a later turn: extends the requests that first held its blocks 1..k-1
            parents[i] = {owner[h] for h in r["hash_ids"][1:k]}
        for h in r["hash_ids"]:
            if h not in seen:
                seen.add(h)
                owner[h] = i
    keep, stack = set(parents), list(parents)
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p not in keep:
                keep.add(p)
                stack.append(p)
    singles = [i for i in range(len(records)) if i not in keep]
    if singles_every > 0:
        keep.update(singles[::singles_every])
    return [records[i] for i in sorted(keep)]


def write_trace(records: list[dict], path: Path) -> None:
    t0 = records[0]["timestamp"]
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps({**r, "timestamp": r["timestamp"] - t0}) + "\n")


def replay_facts(trace: Path, args) -> dict:
    """The scaled workload `bench serve` will replay: later-turn flags, bounds, distinct KV blocks."""
    from pdserve.bench.cli import PROMPT_VOCAB
    from pdserve.core.kvstore.block_hash import hash_blocks
    from pdserve.workloads import block_size, build_prompts, load_workload
    wl = load_workload(f"mooncake:{trace}", length_scale=args.length_scale, time_scale=args.time_scale)
    b = block_size(wl)
    prompts = build_prompts(wl, PROMPT_VOCAB, seed=0)  # what `bench serve` sends (seed 0, one rate)
    seen: set = set()
    kv_seen: set = set()
    later, bound_hit, kv_hit, total = [], 0, 0, 0
    for req, prompt in zip(wl.requests, prompts):
        k = leading_seen(list(req.hash_ids), seen)
        later.append(k > 1)
        bound_hit += min(b * k, req.input_len)
        total += req.input_len
        seen.update(req.hash_ids)
        usable = hash_blocks(prompt[:len(prompt) - 1], BLOCK)
        kv_hit += BLOCK * leading_seen(usable, kv_seen)
        kv_seen.update(hash_blocks(prompt, BLOCK))
    longest = max(r.input_len + r.output_len for r in wl.requests)
    return {"requests": len(wl.requests), "later_turns": sum(later), "later": later, "hash_block_tokens": b,
            "prompt_tokens": total, "output_tokens": sum(r.output_len for r in wl.requests),
            "longest_request_tokens": longest, "arrival_span_s": round(wl.duration_s, 1),
            "distinct_kv_blocks": len(kv_seen), "bound_infinite_cache": bound_hit / total,
            "bound_kv_blocks": kv_hit / total}


def gb_for(blocks: int) -> float:
    """GiB flag value holding at least `blocks` blocks (the server floors GiB / block bytes)."""
    return float(np.ceil((blocks + 1) * BLOCK_BYTES / 2**30 * 1000) / 1000)


# -------------------------------------------------------------------------------- parts: ttft + hits
def warmup(url: str) -> None:
    import httpx
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    rng = np.random.RandomState(12345)  # ids unlike any replayed block
    for n in (40, 300):
        body = {"model": model, "prompt": rng.randint(100, 31900, size=n).tolist(), "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        httpx.post(url + "/v1/completions", json=body, timeout=300).raise_for_status()


def replay(mode: str, config: str, server_args: list[str], trace: Path, facts: dict, args, out: Path) -> dict:
    run_dir = out / f"{mode}-{config}"
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"\n[{mode}/{config}] pdserve serve {' '.join(server_args)}", flush=True)
    server = Server(server_args, run_dir / "server.log")
    try:
        warmup(server.url)
        time.sleep(1.0)  # worker stats reach /metrics every 0.25 s
        before = server.metrics()
        cmd = [*PDSERVE, "bench", "serve", "--endpoint", server.url, "--workload", f"mooncake:{trace}",
               "--length-scale", str(args.length_scale), "--time-scale", str(args.time_scale),
               "--output", str(run_dir), "--label", f"{mode}-{config}", "--no-progress"]
        print("$ pdserve " + " ".join(cmd[3:]), flush=True)
        t0 = time.monotonic()
        rc = subprocess.run(cmd).returncode
        wall = time.monotonic() - t0
        time.sleep(1.5)
        after = server.metrics()
    finally:
        server.stop()
    if rc != 0:
        raise RuntimeError(f"bench serve failed ({rc}) for {mode}/{config}")
    result = json.loads((run_dir / "result.json").read_text())
    reqs = result["runs"][0]["requests"]
    ttft_all, ttft_later, tpot_all, errors = [], [], [], []
    for r, is_later in zip(reqs, facts["later"]):
        if r["error"] is not None or r["first_token_s"] is None:
            errors.append(r["error"])
            continue
        t = r["first_token_s"] - r["start_s"]
        ttft_all.append(t)
        if r["output_tokens"] > 1 and r["token_times"]:
            tpot_all.append((r["token_times"][-1] - r["first_token_s"]) / (r["output_tokens"] - 1))
        if is_later:
            ttft_later.append(t)

    def delta(name: str, *keys: str) -> dict[tuple, float]:
        a, b = by_labels(after, name, *keys), by_labels(before, name, *keys)
        return {k: v - b.get(k, 0.0) for k, v in a.items()}

    hits = delta("pdserve_prefix_cache_hit_tokens_total", "worker", "tier")
    queries = delta("pdserve_prefix_cache_query_tokens_total", "worker")
    tier_bytes = delta("pdserve_kv_tier_bytes_total", "worker", "tier", "direction")
    blocks = by_labels(after, "pdserve_kv_tier_blocks", "worker", "tier")
    preempt = delta("pdserve_preemptions_total", "worker")
    workers = sorted({w for (w, _t) in hits} | {w for (w,) in queries})
    per_worker = {}
    for w in workers:
        q = queries.get((w,), 0.0)
        tiers = {t: v for (ww, t), v in hits.items() if ww == w}
        per_worker[w] = {
            "query_tokens": q, "hit_tokens": tiers,
            "hit_ratio_of_queries": {t: (v / q if q else None) for t, v in tiers.items()},
            "hit_ratio_of_replay_prompt_tokens": {t: v / facts["prompt_tokens"] for t, v in tiers.items()},
            "tier_bytes": {f"{t}_{d}": v for (ww, t, d), v in tier_bytes.items() if ww == w},
            "tier_blocks_at_end": {t: v for (ww, t), v in blocks.items() if ww == w},
            "preemptions": preempt.get((w,), 0.0)}
    return {"server_args": server_args, "wall_s": round(wall, 1), "num_requests": len(reqs),
            "errors": len(errors), "error_samples": sorted(set(map(str, errors)))[:3],
            "ttft_s": {"later": {"n": len(ttft_later), "p50": pct(ttft_later, 50), "p90": pct(ttft_later, 90)},
                       "all": {"n": len(ttft_all), "p50": pct(ttft_all, 50), "p90": pct(ttft_all, 90)}},
            "tpot_s": {"n": len(tpot_all), "p50": pct(tpot_all, 50), "p90": pct(tpot_all, 90)},
            "workers": per_worker, "result_json": str(run_dir / "result.json")}


def part_serving(args, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    records = select_trace(args.window, args.select, args.singles_every)
    trace = out / "selected_trace.jsonl"
    write_trace(records, trace)
    facts = replay_facts(trace, args)
    pool = args.device_blocks or max(int(args.device_fraction * facts["distinct_kv_blocks"]),
                                     2 * -(-facts["longest_request_tokens"] // BLOCK))
    host_blocks = max(int(args.host_fraction * facts["distinct_kv_blocks"]),  # above the pool: it holds a copy
                      pool + -(-facts["longest_request_tokens"] // BLOCK))
    disk_blocks = int(args.disk_fraction * facts["distinct_kv_blocks"])
    host_gb, disk_gb = gb_for(host_blocks), gb_for(disk_blocks)
    print(f"\nreplay: {facts['requests']} requests ({facts['later_turns']} later turns) of the first "
          f"{args.window} ({args.select}), {facts['prompt_tokens']} prompt + {facts['output_tokens']} output tokens, "
          f"arrivals over {facts['arrival_span_s']} s, hash block {facts['hash_block_tokens']} tokens, "
          f"{facts['distinct_kv_blocks']} distinct full KV blocks; device pool {pool} blocks, host "
          f"{host_gb} GiB (~{host_blocks} blocks), disk {disk_gb} GiB (~{disk_blocks} blocks)", flush=True)
    report = {"workload": {k: v for k, v in facts.items() if k != "later"},
              "selection": {"window": args.window, "select": args.select, "singles_every": args.singles_every,
                            "trace": str(TRACE), "selected_trace": str(trace)},
              "device_blocks": pool, "host_gb": host_gb, "disk_gb": disk_gb, "modes": {}}
    for mode in args.modes.split(","):
        base = ["--mode", "colocated"] if mode == "colocated" else ["--mode", "pd", "--num-threads", "1"]
        base += ["--num-kv-blocks", str(pool)]
        runs = {}
        disk_dir = Path(tempfile.mkdtemp(prefix="pdserve-kv-bench-", dir=args.disk_dir))
        try:
            runs["device"] = replay(mode, "device", [*base, "--kv-host-gb", "0"], trace, facts, args, out)
            runs["tiers"] = replay(mode, "tiers", [*base, "--kv-host-gb", str(host_gb), "--kv-disk-dir",
                                                   str(disk_dir), "--kv-disk-gb", str(disk_gb)],
                                   trace, facts, args, out)
        finally:
            shutil.rmtree(disk_dir, ignore_errors=True)
        ratio = {}
        for group in ("later", "all"):
            for q in ("p50", "p90"):
                d, t = runs["device"]["ttft_s"][group][q], runs["tiers"]["ttft_s"][group][q]
                ratio[f"{group}_{q}"] = d / t if d and t else None
        report["modes"][mode] = {**runs, "ttft_ratio_device_over_tiers": ratio}
    return report


def print_serving(rep: dict, parts: set) -> None:
    wl = rep["workload"]
    if "ttft" in parts:
        print("\n== later-turn TTFT: device pool only vs + host + disk tiers (ms) ==")
        print(f"{'mode':10} {'config':7} {'later n':>7} {'later p50':>9} {'later p90':>9} {'all n':>6} "
              f"{'all p50':>8} {'all p90':>8} {'tpot p50':>8} {'errors':>6} {'wall s':>7}")
        for mode, m in rep["modes"].items():
            for cfg in ("device", "tiers"):
                r = m[cfg]
                lt, al = r["ttft_s"]["later"], r["ttft_s"]["all"]
                print(f"{mode:10} {cfg:7} {lt['n']:>7} {ms(lt['p50']):>9} {ms(lt['p90']):>9} {al['n']:>6} "
                      f"{ms(al['p50']):>8} {ms(al['p90']):>8} {ms(r['tpot_s']['p50']):>8} {r['errors']:>6} "
                      f"{r['wall_s']:>7}")
            rt = m["ttft_ratio_device_over_tiers"]
            fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
            print(f"{mode:10} {'ratio':7} {'':>7} {fmt(rt['later_p50']):>9} {fmt(rt['later_p90']):>9} {'':>6} "
                  f"{fmt(rt['all_p50']):>8} {fmt(rt['all_p90']):>8}   (device / tiers)")
    if "hits" in parts:
        print(f"\n== prefix hits per tier / prompt tokens (replay: {wl['prompt_tokens']} prompt tokens) ==")
        print(f"bound: infinite cache (README formula, {wl['hash_block_tokens']}-token hash blocks) "
              f"{wl['bound_infinite_cache']:.3f}; at 16-token KV blocks (exact prompts) {wl['bound_kv_blocks']:.3f}")
        print(f"{'mode':10} {'config':7} {'worker':11} {'queried':>8} {'device':>7} {'host':>7} {'disk':>7} "
              f"{'total':>7} {'of bound':>8}  bytes in/out (MB): host, disk")
        for mode, m in rep["modes"].items():
            for cfg in ("device", "tiers"):
                for w, s in m[cfg]["workers"].items():
                    r = s["hit_ratio_of_replay_prompt_tokens"]
                    tot = sum(r.values())
                    b = s["tier_bytes"]
                    io = (f"{b.get('host_in', 0) / 1e6:.0f}/{b.get('host_out', 0) / 1e6:.0f}, "
                          f"{b.get('disk_in', 0) / 1e6:.0f}/{b.get('disk_out', 0) / 1e6:.0f}") if b else "-"
                    cell = lambda t: f"{r[t]:.3f}" if t in r else "-"  # noqa: E731
                    print(f"{mode:10} {cfg:7} {w:11} {s['query_tokens']:>8.0f} {cell('device'):>7} {cell('host'):>7} "
                          f"{cell('disk'):>7} {tot:>7.3f} {tot / wl['bound_kv_blocks']:>8.2f}  {io}")
        print("(ratios are hit tokens / the replay's prompt tokens; 'of bound' is against the KV-block bound; "
              "in PD the prefill worker's hits are the ones that save compute)")


# ------------------------------------------------------------------------------------- part: context
def part_context(args) -> dict:
    import torch

    from pdserve import LLM, SamplingParams
    from pdserve.errors import ContextLengthExceededError
    from pdserve.model import kernels
    pool, out_n = args.context_pool_blocks, args.context_out_tokens
    pool_tokens = pool * BLOCK
    limit = 8192  # the default model's context
    params = SamplingParams(temperature=0, max_tokens=out_n, ignore_eos=True)
    rng = np.random.RandomState(7)

    def prompt(n: int) -> list[int]:
        return rng.randint(100, 31900, size=n).tolist()

    def warm(llm) -> None:  # first calls pay one-time costs; not part of any number
        llm.generate([np.random.RandomState(99).randint(100, 31900, size=200).tolist()],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    def run(llm, p: list[int]) -> dict:
        t0 = time.monotonic()
        try:
            o = llm.generate([p], params)[0]
        except ContextLengthExceededError as e:
            return {"prompt_tokens": len(p), "ok": False, "error": f"{e.code}: {e.message}"}
        n = len(o.token_ids)
        return {"prompt_tokens": len(p), "ok": True, "wall_s": round(time.monotonic() - t0, 2),
                "ttft_s": round(o.first_token_s - o.arrival_s, 3), "finish_reason": o.finish_reason,
                "output_tokens": n, "tpot_s": (o.finished_s - o.first_token_s) / (n - 1) if n > 1 else None,
                "cached_tokens": o.num_cached_tokens, "token_ids": o.token_ids}

    rep: dict = {"pool_blocks": pool, "pool_tokens": pool_tokens, "out_tokens": out_n, "model_limit": limit}
    print(f"\n[context] device only, pool {pool} blocks = {pool_tokens} tokens", flush=True)
    dev = LLM(num_kv_blocks=pool, kv_host_gb=0)
    warm(dev)
    rep["device_only"] = [run(dev, prompt(n)) for n in (pool_tokens - out_n, pool_tokens, 2 * pool_tokens)]
    del dev
    big_blocks = limit // BLOCK + 8
    print(f"[context] reference: device only, pool {big_blocks} blocks; tiers: pool {pool} + host "
          f"{args.context_host_gb} GiB, hot window default", flush=True)
    tiers = LLM(num_kv_blocks=pool, kv_host_gb=args.context_host_gb)
    ref = LLM(num_kv_blocks=big_blocks, kv_host_gb=0)
    warm(tiers)
    warm(ref)
    hot = tiers.engine.scheduler.window.window
    rep["hot_window_blocks"] = hot
    rep["tiers_max_model_len"] = tiers.engine.scheduler.max_model_len
    rep["tiers"] = []
    multiples = [4] if args.quick else [4, 6, 8]
    tpot_prompts = [prompt(4 * pool_tokens - out_n) for _ in range(args.context_repeats)]
    cold_before = kernels.paths_used().get("cold_kv")
    for m in multiples:
        p = tpot_prompts[0] if m == 4 else prompt(min(m * pool_tokens, limit) - out_n)
        t = run(tiers, p)
        r = run(ref, p)
        t["multiple_of_pool"] = m
        t["reference_ok"] = r["ok"]
        t["tokens_equal_reference"] = bool(t["ok"] and r["ok"] and t["token_ids"] == r["token_ids"])
        if t["ok"] and r["ok"] and not t["tokens_equal_reference"]:
            first = next(i for i, (a, b) in enumerate(zip(t["token_ids"], r["token_ids"])) if a != b)
            t["first_difference_at"] = first
        t["reference"] = {k: r.get(k) for k in ("ttft_s", "tpot_s", "wall_s")}
        rep["tiers"].append(t)
        if m == 4:
            rep["tpot_runs"] = [{"tiers": t["tpot_s"], "big_pool": r["tpot_s"], "equal": t["tokens_equal_reference"]}]
        print(f"  {m}x: tiers ok={t['ok']} ttft {t.get('ttft_s')} s, equal to reference={t['tokens_equal_reference']} "
              f"(reference ttft {r.get('ttft_s')} s)", flush=True)
    for p in tpot_prompts[1:]:
        t, r = run(tiers, p), run(ref, p)
        rep["tpot_runs"].append({"tiers": t.get("tpot_s"), "big_pool": r.get("tpot_s"),
                                 "equal": bool(t["ok"] and r["ok"] and t["token_ids"] == r["token_ids"])})
    rep["cold_kv_calls"] = {"before": cold_before, "after": kernels.paths_used().get("cold_kv")}
    tt = [x["tiers"] for x in rep["tpot_runs"] if x["tiers"]]
    bb = [x["big_pool"] for x in rep["tpot_runs"] if x["big_pool"]]
    rep["tpot_s"] = {"context_tokens": 4 * pool_tokens, "tiers_median": statistics.median(tt) if tt else None,
                     "big_pool_median": statistics.median(bb) if bb else None}
    if tt and bb:
        rep["tpot_s"]["penalty"] = statistics.median(tt) / statistics.median(bb)
    for runs in (rep["device_only"], rep["tiers"]):
        for x in runs:
            if "token_ids" in x:
                x["token_ids"] = x["token_ids"][:8]  # keep the json small
    rep["torch_threads"] = torch.get_num_threads()
    return rep


def print_context(rep: dict) -> None:
    print(f"\n== longest context: pool {rep['pool_blocks']} blocks x {BLOCK} = {rep['pool_tokens']} tokens, "
          f"{rep['out_tokens']} output tokens ==")
    print(f"{'config':22} {'prompt':>6} {'ctx/pool':>8} {'ok':>3} {'ttft s':>7} {'tpot ms':>8} {'= ref':>5}  note")
    for label, runs in (("device only", rep["device_only"]), ("host tier + hot window", rep["tiers"])):
        for x in runs:
            note = x.get("error", x.get("finish_reason", ""))
            if "first_difference_at" in x:
                note += f"; differs from token {x['first_difference_at']}"
            equal = "" if "tokens_equal_reference" not in x else "yes" if x["tokens_equal_reference"] else "NO"
            ratio = (x["prompt_tokens"] + rep["out_tokens"]) / rep["pool_tokens"]
            print(f"{label:22} {x['prompt_tokens']:>6} {ratio:>8.2f} {'yes' if x['ok'] else 'no':>3} "
                  f"{x.get('ttft_s', '-'):>7} {ms(x.get('tpot_s')):>8} {equal:>5}  {note[:70]}")
    print(f"hot window {rep['hot_window_blocks']} blocks; tiers max context {rep['tiers_max_model_len']} tokens")
    t = rep["tpot_s"]
    pen = f"{t['penalty']:.2f}x" if t.get("penalty") else "-"
    print(f"TPOT at {t['context_tokens']} tokens of context ({len(rep['tpot_runs'])} prompts, medians): tiers "
          f"{ms(t['tiers_median'])} ms, big pool {ms(t['big_pool_median'])} ms, penalty {pen}")


# ----------------------------------------------------------------------------------- part: bandwidth
def drop_page_cache(paths: list[Path]) -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError as e:
        reason = e.strerror or str(e)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return f"posix_fadvise(DONTNEED) per file (drop_caches: {reason})"


def part_bandwidth(args) -> dict:
    import torch
    import xxhash

    from pdserve.core.kvstore.kv_tiers import KVLoad, KVOp
    from pdserve.kv.codec import KVCodec
    from pdserve.kv.device_pool import DeviceKVPool
    from pdserve.kv.disk_store import DiskKVStore
    from pdserve.kv.host_store import HostKVStore
    from pdserve.kv.tier_io import TierIO

    class _Config:  # the default model's KV shape
        num_kv_heads, head_dim, num_layers = KV_HEADS, HEAD_DIM, LAYERS

    n, batch, reps = args.io_blocks, args.io_batch_blocks, args.io_repeats
    total = n * BLOCK_BYTES
    print(f"\n[bandwidth] {n} blocks x {BLOCK_BYTES} B = {total / 1e6:.0f} MB per pass, ops of {batch} blocks, "
          f"{reps} timed passes, torch threads {torch.get_num_threads()}", flush=True)
    pool = DeviceKVPool(_Config(), n, BLOCK, KVCodec("auto", HEAD_DIM, torch.float32), torch.device("cpu"))
    for layer in pool.layers:
        layer.normal_()
    host = HostKVStore(n, LAYERS, KV_HEADS, BLOCK, HEAD_DIM, torch.float32)
    assert host.slot_nbytes == BLOCK_BYTES
    root = Path(tempfile.mkdtemp(prefix="pdserve-kv-bw-", dir=args.disk_dir))
    disk = DiskKVStore(str(root), "bench", "w", BLOCK_BYTES)
    io = TierIO(pool.layers, host, disk, n)
    hashes = [0x1000 + i for i in range(n)]
    chunks = [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]
    op_id = iter(range(1, 10**9))
    rows: dict = {}

    def timed(fn, setup=None) -> list[float]:
        out = []
        for _ in range(reps):
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    def record(name: str, times: list[float], nbytes: int = total, **extra) -> None:
        med = statistics.median(times)
        rows[name] = {"GBps": nbytes / med / GB, "median_s": med, "times_s": times, "bytes": nbytes, **extra}

    def run_ops(kind: str, **fields) -> None:
        ops = []
        for c in chunks:
            ops.append(KVOp(next(op_id), kind, tuple(hashes[i] for i in c),
                            **{k: tuple(v[i] for i in c) for k, v in fields.items()}))
        io.submit(ops)
        io.drain(timeout_s=600)
        failed = [f for _, f in io.poll() if f]
        if failed:
            raise RuntimeError(f"{kind}: {failed[0]}")

    ids = list(range(n))
    offload = lambda: run_ops("offload", src=ids, dst=ids)  # noqa: E731
    offload()  # untimed: first touch of the host tier's pages
    record("offload", timed(offload))
    assert all(torch.equal(host.data[:, layer], pool.layers[layer].permute(2, 0, 1, 3, 4))
               for layer in range(LAYERS)), "offload: host slots differ from the device blocks"

    def load() -> None:
        for c in chunks:
            io.load([KVLoad(i, i) for i in c])
    load()
    record("load", timed(load))

    # flush: a fresh disk dir each pass (new files, as in service); the last pass's files stay for prefetch
    stores: list[DiskKVStore] = []

    def new_store() -> None:
        for s in stores:
            shutil.rmtree(s.dir, ignore_errors=True)
        stores.clear()
        io.disk = DiskKVStore(str(root), "bench", f"w{len(os.listdir(root / 'bench'))}", BLOCK_BYTES)
        stores.append(io.disk)
    flush = lambda: run_ops("flush", src=ids)  # noqa: E731
    record("flush", timed(flush, new_store))
    files = [io.disk.path(h) for h in hashes]

    source = host.data.clone()  # what the files hold

    def clear_host() -> None:
        host.data.zero_()
    prefetch = lambda: run_ops("prefetch", dst=ids)  # noqa: E731
    prefetch()  # untimed warm-up: files now in the page cache
    record("prefetch_warm", timed(prefetch, clear_host))
    assert torch.equal(host.data, source), "prefetch: host slots differ from what was flushed"
    methods = []

    def cold() -> None:
        clear_host()
        methods.append(drop_page_cache(files))
    record("prefetch_cold", timed(prefetch, cold))
    rows["prefetch_cold"]["page_cache"] = methods[-1]
    assert torch.equal(host.data, source), "prefetch (cold): host slots differ from what was flushed"
    io.close()

    # ---- ceilings, same total size
    ceil: dict = {}
    a = torch.randn(total // 4)
    b = torch.empty_like(a)
    b.copy_(a)

    def memcpy() -> None:
        b.copy_(a)
    ceil_times = timed(memcpy)
    ceil["memcpy"] = {"GBps": total / statistics.median(ceil_times) / GB, "times_s": ceil_times}
    piece = BLOCK_BYTES // 4

    def memcpy_blocks() -> None:
        for off in range(0, a.numel(), piece):
            b[off:off + piece].copy_(a[off:off + piece])
    t = timed(memcpy_blocks)
    ceil["memcpy_blocks"] = {"GBps": total / statistics.median(t) / GB, "times_s": t}
    buf = memoryview(a.numpy().view(np.uint8))
    path = root / "seq.bin"

    def write(sync: bool) -> None:
        with open(path, "wb") as f:
            for off in range(0, total, BLOCK_BYTES):
                f.write(buf[off:off + BLOCK_BYTES])
            if sync:
                f.flush()
                os.fsync(f.fileno())
    for name, sync in (("file_write", False), ("file_write_fsync", True)):
        t = timed(lambda s=sync: write(s), lambda: path.unlink(missing_ok=True))
        ceil[name] = {"GBps": total / statistics.median(t) / GB, "times_s": t}
    out = memoryview(b.numpy().view(np.uint8))

    def read() -> None:
        with open(path, "rb") as f:
            for off in range(0, total, BLOCK_BYTES):
                f.readinto(out[off:off + BLOCK_BYTES])
    read()
    t = timed(read)
    ceil["file_read_warm"] = {"GBps": total / statistics.median(t) / GB, "times_s": t}
    t = timed(read, lambda: drop_page_cache([path]))
    ceil["file_read_cold"] = {"GBps": total / statistics.median(t) / GB, "times_s": t}
    fdir = root / "plain"
    fdir.mkdir()
    plain = [fdir / f"{i:016x}.kv" for i in range(n)]

    def write_files() -> None:
        for i, p in enumerate(plain):
            with open(p, "wb") as f:
                f.write(buf[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES])

    def read_files() -> None:
        for i, p in enumerate(plain):
            with open(p, "rb") as f:
                f.readinto(out[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES])
    t = timed(write_files, lambda: [p.unlink(missing_ok=True) for p in plain])
    ceil["files_write"] = {"GBps": total / statistics.median(t) / GB, "times_s": t}
    t = timed(read_files)
    ceil["files_read_warm"] = {"GBps": total / statistics.median(t) / GB, "times_s": t}

    def xxh() -> None:
        for off in range(0, total, BLOCK_BYTES):
            xxhash.xxh3_64_intdigest(buf[off:off + BLOCK_BYTES])
    t = timed(xxh)
    ceil["xxh3_64"] = {"GBps": total / statistics.median(t) / GB, "times_s": t}
    shutil.rmtree(root, ignore_errors=True)

    against = {"offload": "memcpy", "load": "memcpy", "flush": "file_write", "prefetch_warm": "file_read_warm",
               "prefetch_cold": "file_read_cold"}
    for name, c in against.items():
        rows[name]["ceiling"] = c
        rows[name]["fraction_of_ceiling"] = rows[name]["GBps"] / ceil[c]["GBps"]
    return {"blocks": n, "block_bytes": BLOCK_BYTES, "batch_blocks": batch, "repeats": reps,
            "tmp_dir_parent": args.disk_dir or tempfile.gettempdir(), "ops": rows, "ceilings": ceil,
            "page_cache_drop": methods[-1] if methods else None}


def print_bandwidth(rep: dict) -> None:
    print(f"\n== tier I/O bandwidth ({rep['blocks']} blocks = {rep['blocks'] * rep['block_bytes'] / 1e6:.0f} MB, "
          f"ops of {rep['batch_blocks']} blocks, median of {rep['repeats']}) ==")
    print(f"{'op':15} {'GB/s':>7} {'ceiling':18} {'GB/s':>7} {'fraction':>8}")
    for name, r in rep["ops"].items():
        c = rep["ceilings"][r["ceiling"]]
        print(f"{name:15} {r['GBps']:>7.2f} {r['ceiling']:18} {c['GBps']:>7.2f} {r['fraction_of_ceiling']:>8.2f}")
    print("other ceilings: " + ", ".join(f"{k} {v['GBps']:.2f}" for k, v in rep["ceilings"].items()
                                         if k not in {r["ceiling"] for r in rep["ops"].values()}))
    print(f"page cache for the cold rows: {rep['page_cache_drop']}")


# -------------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="ttft,hits,context,bandwidth")
    ap.add_argument("--quick", action="store_true", help="smoke run: small sizes, colocated only")
    ap.add_argument("--modes", default=None, help="colocated, pd or both (comma-separated); default colocated")
    ap.add_argument("--window", type=int, default=None, help="first N trace requests to select from (600)")
    ap.add_argument("--select", default="conversations", choices=["conversations", "first"])
    ap.add_argument("--singles-every", type=int, default=0, help="also keep every Nth single-turn request (0: none)")
    ap.add_argument("--length-scale", type=float, default=1 / 64)
    ap.add_argument("--time-scale", type=float, default=None, help="divide trace time by this (default 1)")
    ap.add_argument("--device-blocks", type=int, default=None, help="device pool (default: --device-fraction)")
    ap.add_argument("--device-fraction", type=float, default=0.25)
    ap.add_argument("--host-fraction", type=float, default=0.5)
    ap.add_argument("--disk-fraction", type=float, default=2.0)
    ap.add_argument("--disk-dir", default=None, help="parent of the tmp dirs for the disk tier and file I/O")
    ap.add_argument("--context-pool-blocks", type=int, default=64)
    ap.add_argument("--context-out-tokens", type=int, default=None, help="(32; --quick 8)")
    ap.add_argument("--context-repeats", type=int, default=None, help="(3; --quick 1)")
    ap.add_argument("--context-host-gb", type=float, default=1.0)
    ap.add_argument("--io-blocks", type=int, default=None, help="(1024; --quick 128)")
    ap.add_argument("--io-batch-blocks", type=int, default=128)
    ap.add_argument("--io-repeats", type=int, default=None, help="(5; --quick 2)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    q = args.quick
    for name, full, quick in (("modes", "colocated", "colocated"), ("window", 600, 250), ("time_scale", 1.0, 2.0),
                              ("context_out_tokens", 32, 8), ("context_repeats", 3, 1), ("io_blocks", 1024, 128),
                              ("io_repeats", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    parts = set(args.parts.split(","))
    unknown = parts - {"ttft", "hits", "context", "bandwidth"}
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}")
    suffix = "_quick" if q else ""
    output = Path(args.output or ROOT / "bench_results" / f"kv_tiers{suffix}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    report = json.loads(output.read_text()) if output.exists() else {}
    cpu = host_cpu()
    print(f"host: {cpu}, {os.cpu_count()} cores, python {platform.python_version()}", flush=True)
    report.update({"host_cpu": cpu, "cores": os.cpu_count(),
                   "date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "flags": vars(args)})
    report.setdefault("parts", {})

    def save() -> None:
        output.write_text(json.dumps(report, indent=1))

    if parts & {"ttft", "hits"}:
        if not TRACE.exists():
            raise SystemExit(f"no trace at {TRACE} (set PDSERVE_TRACES)")
        rep = part_serving(args, ROOT / "bench_results" / f"kv_tiers{suffix}")
        report["parts"]["serving"] = rep
        save()
        print_serving(rep, parts)
    if "context" in parts:
        rep = part_context(args)
        report["parts"]["context"] = rep
        save()
        print_context(rep)
    if "bandwidth" in parts:
        rep = part_bandwidth(args)
        report["parts"]["bandwidth"] = rep
        save()
        print_bandwidth(rep)
    save()
    print(f"\nwrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
