"""`pdserve bench serve` and `pdserve bench compare`: flags, and the glue from workload to report."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.errors import InvalidRequestError

# Prompt token ids are drawn below this. The OpenAI API does not tell the vocabulary size, so use a bound
# that every Llama-family tokenizer (32k ids and up) accepts.
PROMPT_VOCAB = 32000


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="load generator and benchmark reports")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    srv = bsub.add_parser("serve", help="replay a workload against an OpenAI-compatible endpoint")
    srv.add_argument("--endpoint", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    srv.add_argument("--workload", required=True,
                     help="mooncake:PATH | azure:PATH | lengths:PATH | fixed:IN,OUT")
    srv.add_argument("--model", default=None, help="model name to send; default: the endpoint's first model")
    srv.add_argument("--rate", type=float, default=None,
                     help="requests/s: arrival rate for lengths/fixed; for traces, time is scaled to this mean rate")
    srv.add_argument("--rates", default=None, help="comma-separated rates to sweep (SLO attainment vs rate, goodput)")
    srv.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"])
    srv.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gamma inter-arrivals")
    srv.add_argument("--num-requests", type=int, default=None, help="requests of a fixed workload")
    srv.add_argument("--concurrency", type=int, default=None, help="most requests in flight (closed loop)")
    srv.add_argument("--length-scale", type=float, default=1.0, help="multiply trace lengths by this")
    srv.add_argument("--time-scale", type=float, default=1.0, help="divide trace time by this (20: 1 h -> 3 min)")
    srv.add_argument("--max-requests", type=int, default=None, help="keep the first N requests")
    srv.add_argument("--max-input-len", type=int, default=None, help="clip prompt lengths")
    srv.add_argument("--max-output-len", type=int, default=None, help="clip output lengths")
    srv.add_argument("--block-tokens", type=int, default=512, help="tokens per Mooncake hash_id block (before scaling)")
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--temperature", type=float, default=0.0)
    srv.add_argument("--slo-ttft-ms", type=float, default=None)
    srv.add_argument("--slo-tpot-ms", type=float, default=None)
    srv.add_argument("--tier-mix", default=None, metavar="NAME=FRACTION[,...]",
                     help="send each request with a service_tier drawn from this mix (seeded by --seed), e.g. "
                          "priority=0.2,default=0.6,flex=0.2; default: send none")
    srv.add_argument("--service-tier", action="append", default=[], metavar="NAME:ttft_ms=X,tpot_ms=Y",
                     help="a service tier's SLOs, as `pdserve serve` takes them (repeatable): the report's "
                          "per-tier attainment uses them; a limit not given falls back to --slo-ttft-ms/--slo-tpot-ms")
    srv.add_argument("--price-per-hour", default=None, metavar="USD",
                     help="the endpoint's price per hour (all its GPUs): the report gives the run's cost and USD per "
                          "1k tokens at it (any server); default: a pdserve server's own pdserve_cost_usd_total "
                          "(`pdserve serve --price-per-hour ROLE=USD`), per service tier, else no cost")
    srv.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    srv.add_argument("--label", default=None, help="name of this run in comparisons; default: the output dir name")
    srv.add_argument("--output", default=None, help="directory for result.json and the plots")
    srv.add_argument("--no-progress", action="store_true")
    srv.set_defaults(func=cmd_bench_serve)
    cmp = bsub.add_parser("compare", help="put several result.json files side by side")
    cmp.add_argument("results", nargs="+", help="result.json files or the directories holding them")
    cmp.add_argument("--labels", default=None, help="comma-separated names, one per result")
    cmp.add_argument("--output", default=None, help="directory for comparison.json and compare.png")
    cmp.set_defaults(func=cmd_bench_compare)


def _rates(args) -> list[float | None]:
    if args.rates:
        try:
            rates = [float(r) for r in args.rates.split(",") if r.strip()]
        except ValueError as e:
            raise InvalidRequestError(f"--rates must be numbers separated by commas, got {args.rates!r}") from e
        if not rates or any(r <= 0 for r in rates):
            raise InvalidRequestError("--rates must be positive")
        return sorted(rates)
    if args.rate is not None and args.rate <= 0:
        raise InvalidRequestError("--rate must be positive", param="rate")
    return [args.rate]


def _workload_at(args, rate: float | None):
    from pdserve.workloads import load_workload
    common = dict(arrival=args.arrival, cv=args.cv, num_requests=args.num_requests, length_scale=args.length_scale,
                  max_requests=args.max_requests, max_input_len=args.max_input_len,
                  max_output_len=args.max_output_len, seed=args.seed)
    trace = args.workload.split(":", 1)[0] in ("mooncake", "azure")
    if not trace:
        return load_workload(args.workload, rate=rate, time_scale=args.time_scale, **common)
    workload = load_workload(args.workload, time_scale=args.time_scale, **common)
    if rate is None:
        return workload
    native = _mean_rate(workload)  # requests/s at --time-scale; stretch time to reach `rate`
    return load_workload(args.workload, time_scale=args.time_scale * rate / native, **common)


def _mean_rate(workload) -> float:
    reqs = workload.requests
    span = reqs[-1].arrival_s - reqs[0].arrival_s if len(reqs) > 1 else 0.0
    if span <= 0:
        raise InvalidRequestError("the trace has no time span to scale to a rate", param="rate")
    return (len(reqs) - 1) / span


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from pdserve.bench.kv_lifecycle import kv_delta, scrape
    from pdserve.bench.metrics import jitter_p99_ms
    from pdserve.bench.report import BenchResult, print_table, write_result
    from pdserve.bench.run_cost import parse_price, run_cost
    from pdserve.bench.runner import RunConfig, discover_model, run
    from pdserve.bench.tier_mix import tier_flags, workload_tiers
    from pdserve.workloads import build_prompts

    rates = _rates(args)
    price = parse_price(args.price_per_hour)
    mix, _ = tier_flags(args)
    workloads = [_workload_at(args, r) for r in rates]  # all checked before any traffic
    model = discover_model(args.endpoint, args.model)
    cfg = RunConfig(args.endpoint, model, args.concurrency, args.temperature, args.timeout_s, not args.no_progress)
    result = BenchResult(endpoint=args.endpoint, model=model, workload=args.workload,
                         label=args.label or (Path(args.output).name if args.output else args.workload),
                         slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                         workload_description=workloads[0].description, service_tiers=list(args.service_tier),
                         tier_mix=mix)
    for i, (rate, workload) in enumerate(zip(rates, workloads)):
        # Fresh token content per rate (same lengths, same sharing structure), so a sweep's later runs do
        # not hit the prefix cache that earlier runs filled.
        prompts = build_prompts(workload, PROMPT_VOCAB, block_tokens=args.block_tokens, seed=args.seed + 7919 * i)
        label = f"rate {rate:g}/s" if rate else "requests"
        tiers = workload_tiers(mix, len(workload.requests), args.seed)  # the same tags at every rate
        before = scrape(args.endpoint)  # the server's KV delivery counters around the run
        records, duration, start = run(workload, prompts, cfg, label, tiers)
        after = scrape(args.endpoint)
        kv = kv_delta(before, after)
        if kv is not None:
            kv["p99_inter_token_jitter_ms"] = jitter_p99_ms(records)
        result.add_run(rate, records, duration, start, kv=kv,
                       cost=run_cost(records, duration, price, before, after))
    print_table(result)
    if args.output:
        print(f"wrote {write_result(result, Path(args.output))}")
    return 0




def cmd_bench_compare(args: argparse.Namespace) -> int:
    from pdserve.bench.report import compare
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.results):
        raise InvalidRequestError("--labels needs one name per result", param="labels")
    compare([Path(r) for r in args.results], labels, Path(args.output) if args.output else None)
    return 0
