"""The `pdserve` command line. Bad input ends in a one-line `error: ...` and exit status 2."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from pdserve.engine.config import EngineConfig
from pdserve.errors import PdserveError
from pdserve.flags import add_config_args


# commands that sample nothing a request left unset (a worker samples what its gateway filled in) have no
# --generation-config
NOT_SAMPLING = frozenset({"generation_config"})


def add_engine_args(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    add_config_args(parser, EngineConfig, skip | {"service_tiers"})
    parser.add_argument("--service-tier", action="append", default=[], metavar="NAME:ttft_ms=X,tpot_ms=Y[,share=Z]",
                        help="a service tier's SLOs (priority, default, flex) and the priority tier's reserved "
                             "share of each worker (repeatable); tiers without an SLO are best effort")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from pdserve.core.service_tiers import ServiceTiers
    # a field a command has no flag for (serve's model: ServeConfig's; worker's generation_config) keeps its default
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    values["service_tiers"] = tuple(ServiceTiers.from_specs(getattr(args, "service_tier", None) or ()).specs())
    return EngineConfig(**values)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    unset = "default: --generation-config's"
    p.add_argument("--temperature", type=float, default=None, help=f"0 = greedy; {unset}, else 0 (greedy)")
    p.add_argument("--top-p", type=float, default=None, help=f"{unset}, else 1")
    p.add_argument("--top-k", type=int, default=None, help=f"{unset}, else 0 (no top-k cut)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace, config: EngineConfig):
    """The flags' sampling params: a field not given takes the model's default (--generation-config), else
    greedy decoding, this command's own default."""
    from pdserve.core.sampling_params import SamplingParams
    from pdserve.model.generation_config import sampling_defaults
    from pdserve.model.loader import resolve_model_dir
    defaults = sampling_defaults(config.generation_config, config.model, resolve_model_dir(config.model))
    given = defaults.fill(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    return SamplingParams(**{"temperature": 0.0, **given}, max_tokens=args.max_tokens, stop=tuple(args.stop))


def cmd_generate(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    params = _sampling_params(args, config)  # validate before paying for a model load
    from pdserve.engine.llm import LLM
    llm = LLM(**dataclasses.asdict(config))
    print(llm.generate(args.prompt, params)[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    params = _sampling_params(args, config)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.message}]
    from pdserve.engine.llm import LLM
    llm = LLM(**dataclasses.asdict(config))
    print(llm.chat(messages, params)[0].text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.server.launch import ServeConfig
    from pdserve.server.serve import serve
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)}
    cfg = ServeConfig(**{k: tuple(v or ()) if isinstance(getattr(ServeConfig, k, None), tuple) else v
                         for k, v in values.items()})  # repeatable flags: tuples
    config = engine_config_from_args(args)
    from pdserve.engine.codec_gate import gate_serve
    for result in gate_serve(config, cfg):  # refuses (one line) a KV codec that fails this model
        print(result.line(), file=sys.stderr)
    engine = dataclasses.asdict(config)
    # the workers load the model directory they are given; a quantized load also reads a GGUF's own blocks, and
    # the prepared-weights cache keys on that file: the model as served (without it, the embedded GGUF's)
    engine["model"] = cfg.model
    return serve(cfg, engine)


def cmd_check_kv(args: argparse.Namespace) -> int:
    """Exit 0 when every KV codec of the config passes the gate on its model, 1 when one fails."""
    import json
    config = engine_config_from_args(args)
    from pdserve.engine.codec_gate import check_codecs, engine_codecs
    codecs = engine_codecs(config)
    if not codecs:
        raise PdserveError("check-kv compares a KV codec with exact KV: pass --kv-cache-dtype (not auto), "
                           "--kv-host-cache-dtype or --kv-disk-cache-dtype")
    results = check_codecs(config, codecs, use_cache=False)
    for r in results:
        print(json.dumps(r.as_json()) if args.json else r.line())
    return 0 if all(r.passed for r in results) else 1


def cmd_worker(args: argparse.Namespace) -> int:
    from pdserve.worker.joined import worker_spec
    from pdserve.core.settings import CadenceSettings, CalibrationSettings, DeliverySettings, SupervisionSettings, pick
    config = engine_config_from_args(args)
    spec = worker_spec(args.role, args.join, dataclasses.asdict(config), name=args.name,
                       data_host=args.data_host, supervision=pick(SupervisionSettings, args),
                       delivery=DeliverySettings(delivery=args.delivery, delivery_backlog_s=args.delivery_backlog_s,
                                                 kv_wire_dtype=args.kv_wire_dtype),
                       cadence=pick(CadenceSettings, args), calibration=pick(CalibrationSettings, args),
                       join_timeout_s=args.join_timeout_s)
    from pdserve.engine.codec_gate import gate_serve
    for result in gate_serve(config, args):  # refuses (one line) a KV codec that fails this model, as serve does
        print(result.line(), file=sys.stderr)
    from pdserve.worker.worker import run
    return run(spec)


def _add_worker_parser(sub) -> None:
    from pdserve.worker.spec import WorkerSpec
    from pdserve.core.settings import (CadenceSettings, CalibrationSettings, CodecGateSettings, DeliverySettings,
                                       SupervisionSettings, default_of)
    w = sub.add_parser("worker", help="start a worker that joins a running pdserve serve (its --control-port)")
    w.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"])
    w.add_argument("--join", required=True, metavar="tcp://HOST:PORT",
                   help="the gateway's control address (pdserve serve --control-port); the deployment secret "
                        "comes from PDSERVE_DEPLOYMENT_SECRET")
    w.add_argument("--name", default=None, help="its name (metrics' worker label); default: ROLE-HOST-PID")
    w.add_argument("--data-host", default=None,
                   help="address it binds its command and KV sockets on and tells its peers; default: the "
                        "address this host reaches the gateway from")
    w.add_argument("--join-timeout-s", type=float, default=default_of(WorkerSpec, "join_timeout_s"),
                   help="exit (status 2) when the gateway has not taken it this long after it is ready")
    add_config_args(w, SupervisionSettings)
    # a joined worker's link shares and rate are its spec's defaults: no flags for them
    add_config_args(w, DeliverySettings, skip=frozenset({"link_share", "link_gbps"}))
    add_config_args(w, CadenceSettings)
    add_config_args(w, CalibrationSettings)
    add_config_args(w, CodecGateSettings)
    add_engine_args(w, skip=NOT_SAMPLING)
    w.set_defaults(func=cmd_worker)


def cmd_export_hf(args: argparse.Namespace) -> int:
    """Write the model pdserve serves as a Hugging Face directory (fp32 safetensors, tokenizer, chat
    template), so peers (vLLM, transformers) load exactly the same weights."""
    import shutil
    from pathlib import Path

    from pdserve.errors import InvalidRequestError
    from pdserve.model.loader import resolve_model_dir
    out = Path(args.output)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise InvalidRequestError(f"{out} exists and is not empty (pass --force to overwrite)", param="output")
    src = resolve_model_dir(args.model)
    try:
        shutil.copytree(src, out, dirs_exist_ok=True)
    except OSError as e:
        raise InvalidRequestError(f"cannot write {out}: {e.strerror or e}", param="output") from e
    print(out.resolve())
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    if args.from_server and args.merge:
        raise PdserveError("give --from-server or --merge, not both")
    if args.from_server:
        result = _profile_from_server(args.from_server, args.api_key)
    elif args.merge:
        from pdserve.engine.profiler import merge_profiles
        result = merge_profiles(args.merge)
    else:
        from pdserve.engine.profiler import run_profile
        result = run_profile(engine_config_from_args(args), _positive_ints(args.prefill_tokens, "prefill-tokens"),
                             _positive_ints(args.decode_batches, "decode-batches"),
                             _positive_ints(args.decode_contexts, "decode-contexts"))
    try:
        Path(args.output).write_text(json.dumps(result, indent=1))
    except OSError as e:
        raise PdserveError(f"cannot write {args.output}: {e.strerror or e}") from e
    p, d = result["prefill"], result["decode"]
    print(f"prefill_s = {p['a']:.4g} + {p['b']:.4g}*tokens + {p['c']:.4g}*tokens^2")
    print(f"decode_s  = {d['a']:.4g} + {d['b']:.4g}*context_sum + {d['c']:.4g}*batch")
    print(f"wrote {args.output}")
    return 0


def _profile_from_server(url: str, api_key: str | None) -> dict:
    """The time model of a running server's served steps (GET /v1/admin/steps; `pdserve.sim.from_server`), in
    `pdserve profile`'s JSON with the records it came from (`steps`)."""
    import json

    from pdserve.sim.from_server import fit_from_steps
    records = _get_json(url, "/v1/admin/steps", api_key).get("data")
    if not isinstance(records, list):
        raise PdserveError(f"{url}/v1/admin/steps did not answer a list of step records")
    model = fit_from_steps(records, {"source": f"server {url}", "units": "seconds; tokens; context tokens; requests"})
    m = model.meta
    print(f"fitted to {m['steps_fitted']['prefill']} prefill and {m['steps_fitted']['decode']} decode steps of {url} "
          f"(left out as stalls: {m['steps_stalled']['prefill']} and {m['steps_stalled']['decode']})")
    return {**json.loads(model.to_json()), "steps": records}


def _get_json(url: str, path: str, api_key: str | None) -> dict:
    """GET `url` + `path` (with `Authorization: Bearer api_key` if given) as JSON; failures: one-line errors."""
    import json
    import urllib.error
    import urllib.request
    full = url.rstrip("/").removesuffix("/v1") + path
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(full, headers=headers), timeout=30) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise PdserveError(f"{full} answered HTTP {e.code}" + (" (give --api-key)" if e.code == 401 else "")) from None
    except (urllib.error.URLError, OSError) as e:
        raise PdserveError(f"cannot reach {full}: {getattr(e, 'reason', None) or e}") from None
    except ValueError as e:  # a malformed URL, or an answer that is not JSON
        raise PdserveError(f"{full}: {e}") from None
    if not isinstance(body, dict):
        raise PdserveError(f"{full} did not answer a JSON object")
    return body


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise PdserveError(f"--{flag} takes a comma-separated list of positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode-disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt and print the completion")
    gen.add_argument("--prompt", required=True)
    chat = sub.add_parser("chat", help="answer one chat message using the model's chat template")
    chat.add_argument("--message", required=True)
    chat.add_argument("--system", default=None, help="optional system message")
    for p, fn in ((gen, cmd_generate), (chat, cmd_chat)):
        _add_sampling_args(p)
        add_engine_args(p)
        p.set_defaults(func=fn)
    from pdserve.server.launch import ServeConfig
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API with prefill/decode workers")
    add_config_args(srv, ServeConfig)
    add_engine_args(srv, skip=frozenset({"model"}))
    srv.set_defaults(func=cmd_serve)
    _add_worker_parser(sub)
    check = sub.add_parser("check-kv", help="KV codec gate: a fixed text through exact and coded KV on this model "
                                            "(perplexity change, top-1 and greedy agreement, pass or fail)")
    check.add_argument("--json", action="store_true", help="one JSON object per codec instead of one line")
    add_engine_args(check, skip=NOT_SAMPLING)
    check.set_defaults(func=cmd_check_kv)
    exp = sub.add_parser("export-hf", help="write the served model as a Hugging Face directory (for peers)")
    exp.add_argument("--output", required=True, help="directory to write")
    exp.add_argument("--model", default=None, help="model to export; default: the embedded default model")
    exp.add_argument("--force", action="store_true", help="write into a non-empty directory")
    exp.set_defaults(func=cmd_export_hf)
    prof = sub.add_parser("profile", help="measure engine step times and fit the simulator's time model")
    prof.add_argument("--output", required=True, help="JSON file for the fitted coefficients and samples")
    from pdserve.engine import profiler as pr
    prof.add_argument("--prefill-tokens", default=",".join(map(str, pr.PREFILL_TOKENS)),
                      help="prompt lengths of the timed prefill steps (comma-separated)")
    prof.add_argument("--decode-batches", default=",".join(map(str, pr.DECODE_BATCHES)),
                      help="batch sizes of the timed decode steps (comma-separated)")
    prof.add_argument("--decode-contexts", default=",".join(map(str, pr.DECODE_CONTEXTS)),
                      help="context length per request of the timed decode steps (comma-separated)")
    prof.add_argument("--merge", nargs="+", metavar="FIT.json", default=None,
                      help="measure nothing: fit over the samples of these earlier profiles together")
    prof.add_argument("--from-server", metavar="URL", default=None,
                      help="measure nothing: fit to the steps a running pdserve server reports (GET "
                           "/v1/admin/steps), timed under serving conditions")
    prof.add_argument("--api-key", default=None, help="with --from-server: the server's API key, if it needs one")
    add_engine_args(prof, skip=NOT_SAMPLING)
    prof.set_defaults(func=cmd_profile)
    from pdserve.bench.cli import add_bench_parser
    add_bench_parser(sub)
    from pdserve.sim.cli import add_sim_parsers
    add_sim_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PdserveError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
