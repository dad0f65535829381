"""One config slice per concern (`pdserve.core.settings`): each shared setting has one default, and its flag has
the same name, default and help on `pdserve serve`, `pdserve worker` and `pdserve simulate`."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from pdserve.cli import build_parser
from pdserve.conductor.admission import Admission
from pdserve.worker.joined import worker_spec
from pdserve.worker.spec import WorkerSpec
from pdserve.core.pd.delivery import DeliveryPolicy, WaterLevel
from pdserve.core.settings import (AdmissionSettings, CadenceSettings, CalibrationSettings, CodecSettings,
                                   DeliverySettings, KvBlockSettings, KvTierSettings, RoutingSettings,
                                   SupervisionSettings, default_of)
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import InvalidRequestError
from pdserve.server.launch import ServeConfig
from pdserve.sim.cluster import SIM_KV_TIERS, ClusterSpec
from pdserve.sim.engine import SimEngine

SLICES = (DeliverySettings, AdmissionSettings, CadenceSettings, KvTierSettings, CodecSettings, SupervisionSettings,
          RoutingSettings, KvBlockSettings, CalibrationSettings)
# Which settings each command takes (the rest of a slice is not that command's setting).
COMMANDS = {
    "serve": {s: {f.name for f in dataclasses.fields(s)} for s in SLICES},
    "worker": {SupervisionSettings: {"kv_timeout_s", "drain_timeout_s"},
               DeliverySettings: {"delivery", "delivery_backlog_s"}, CadenceSettings: {"decode_cadence"},
               KvTierSettings: {"kv_host_gb", "kv_disk_gb", "kv_eviction_policy"}, CodecSettings: {"kv_cache_dtype"},
               KvBlockSettings: {"block_size", "num_kv_blocks"}, CalibrationSettings: {"calibration"}},
    "simulate": {DeliverySettings: {f.name for f in dataclasses.fields(DeliverySettings)},
                 AdmissionSettings: {"admission", "admission_margin"}, CadenceSettings: {"decode_cadence"},
                 KvTierSettings: {"kv_host_gb", "kv_disk_gb", "kv_eviction_policy"}, CodecSettings: {"kv_cache_dtype"},
                 RoutingSettings: {f.name for f in dataclasses.fields(RoutingSettings)},
                 KvBlockSettings: {"block_size", "num_kv_blocks"}},
}


def _actions(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return {a.dest: a for a in sub.choices[command]._actions}  # noqa: SLF001


def _field(slice_cls, name: str) -> dataclasses.Field:
    return slice_cls.__dataclass_fields__[name]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_shared_flag_has_the_slice_name_default_and_help(command):
    actions = _actions(command)
    for slice_cls, names in COMMANDS[command].items():
        for name in names:
            action = actions[name]
            assert action.option_strings[0] == "--" + name.replace("_", "-")
            old = "".join(f" ({o}: deprecated)" for o in action.option_strings[1:] if not o.startswith("--no-"))
            assert action.help == _field(slice_cls, name).metadata["help"].replace("%", "%%") + old, name  # (literal %)
            want = getattr(SIM_KV_TIERS, name) if command == "simulate" and slice_cls is KvTierSettings else \
                default_of(slice_cls, name)
            assert action.default == want, (command, name)


def test_a_shared_flag_is_spelled_and_explained_alike_on_every_command():
    seen: dict[str, tuple] = {}
    for command in COMMANDS:
        for dest, action in _actions(command).items():
            if any(dest in names for names in COMMANDS[command].values()):
                key = (action.option_strings[0], action.help.split(" (--")[0])
                assert seen.setdefault(dest, key) == key, (command, dest)
    assert len(seen) == sum(len(dataclasses.fields(s)) for s in SLICES)


def test_the_simulators_own_kv_tier_defaults_differ_only_in_size():
    assert dataclasses.replace(SIM_KV_TIERS, kv_host_gb=default_of(KvTierSettings, "kv_host_gb"),
                               kv_disk_gb=default_of(KvTierSettings, "kv_disk_gb")) == KvTierSettings()
    spec = ClusterSpec()
    assert (spec.host_kv_gb, spec.disk_kv_gb) == (SIM_KV_TIERS.kv_host_gb, SIM_KV_TIERS.kv_disk_gb)


def test_every_config_takes_its_defaults_from_the_slices():
    configs = (ServeConfig, EngineConfig, WorkerSpec, ClusterSpec)
    checked = 0
    for config in configs:
        own = {f.name: f for f in dataclasses.fields(config)}
        for slice_cls in SLICES:
            for f in dataclasses.fields(slice_cls):
                if f.name in own:
                    assert own[f.name].default == f.default, (config.__name__, f.name)
                    checked += 1
    assert checked >= 25
    assert WaterLevel().high_s == default_of(DeliverySettings, "delivery_backlog_s")
    assert DeliveryPolicy().mode == default_of(DeliverySettings, "delivery")
    admission = Admission()
    assert (admission.margin, admission.max_outstanding) == (default_of(AdmissionSettings, "admission_margin"),
                                                             default_of(AdmissionSettings, "max_outstanding"))
    for engine in (LLMEngine, SimEngine):
        param = inspect.signature(engine).parameters["kv_eviction_policy"]
        assert param.default == default_of(KvTierSettings, "kv_eviction_policy")
    assert inspect.signature(worker_spec).parameters["join_timeout_s"].default == WorkerSpec.join_timeout_s


def test_old_simulate_spellings_warn_and_still_work(capsys):
    base = ["simulate", "--workload", "synthetic", "--model", "llama-3-8b"]
    args = build_parser().parse_args([*base, "--host-kv-gb", "4", "--disk-kv-gb", "8"])
    assert (args.kv_host_gb, args.kv_disk_gb) == (4.0, 8.0)
    assert capsys.readouterr().err.splitlines() == ["warning: --host-kv-gb is deprecated; use --kv-host-gb",
                                                    "warning: --disk-kv-gb is deprecated; use --kv-disk-gb"]
    args = build_parser().parse_args([*base, "--kv-host-gb", "3", "--kv-disk-gb", "2"])
    assert (args.kv_host_gb, args.kv_disk_gb) == (3.0, 2.0)
    assert capsys.readouterr().err == ""


def test_a_bad_shared_setting_is_refused_alike_everywhere():
    for make in (ServeConfig, ClusterSpec, DeliverySettings):
        with pytest.raises(InvalidRequestError, match="--delivery-backlog-s must be >= 0"):
            make(delivery_backlog_s=-1)
        with pytest.raises(InvalidRequestError, match="delivery must be one of"):
            make(delivery="lifo")
    for make in (ServeConfig, ClusterSpec, AdmissionSettings):
        with pytest.raises(InvalidRequestError, match="--admission must be predict or off"):
            make(admission="maybe")
    for make in (ServeConfig, CalibrationSettings):
        with pytest.raises(InvalidRequestError, match="--calibration must be one of cached, fresh, off"):
            make(calibration="always")
    with pytest.raises(InvalidRequestError, match="eviction"):
        EngineConfig(kv_eviction_policy="fifo")
    with pytest.raises(InvalidRequestError, match="eviction"):
        ClusterSpec(kv_eviction_policy="fifo")


# Each reader of the KV block size and of the batch defaults, printed after the one declaration of each was
# changed (in a fresh process, before any reader is imported): a reader with its own literal prints the old value.
_READERS = """
import inspect, json, sys
from pdserve.core import settings
from pdserve.core.sched.schedule import SchedulerConfig
settings.KvBlockSettings.__dataclass_fields__["block_size"].default = 32
for name, value in {"max_num_seqs": 96, "max_num_batched_tokens": 4096, "queue_policy": "fcfs"}.items():
    SchedulerConfig.__dataclass_fields__[name].default = value
from pdserve.cli import build_parser
from pdserve.conductor.admission import WorkerModel
from pdserve.conductor.conductor_core import ConductorCore
from pdserve.conductor.wire import Ready
from pdserve.engine.config import EngineConfig
from pdserve.engine.executor import FakeExecutor
from pdserve.sim.cluster import ClusterSpec
from pdserve.sim.executor import SimExecutor
commands = build_parser()._subparsers._group_actions[0].choices
engine, ready = EngineConfig(), Ready("w", "decode")
print(json.dumps({
    "block_size": {"EngineConfig": engine.block_size, "ClusterSpec": ClusterSpec().block_size,
                   "Ready": ready.block_size, "FakeExecutor": FakeExecutor().block_size,
                   "ConductorCore": inspect.signature(ConductorCore).parameters["block_size"].default,
                   "SimExecutor": inspect.signature(SimExecutor).parameters["block_size"].default,
                   **{c: commands[c].parse_args([] if c == "serve" else ["--role", "decode", "--join", "tcp://h:1"]
                                                if c == "worker" else ["--workload", "w", "--model", "m"]).block_size
                      for c in ("serve", "worker", "simulate")}},
    "max_num_batched_tokens": {"EngineConfig": engine.max_num_batched_tokens, "WorkerModel": WorkerModel().budget,
                               "Ready": ready.max_num_batched_tokens},
    "max_num_seqs": {"EngineConfig": engine.max_num_seqs}, "queue_policy": {"EngineConfig": engine.queue_policy}}))
"""


def test_the_block_size_and_the_batch_defaults_are_declared_once():
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _READERS], capture_output=True, text=True, timeout=120, check=True)
    read = json.loads(out.stdout)
    want = {"block_size": 32, "max_num_batched_tokens": 4096, "max_num_seqs": 96, "queue_policy": "fcfs"}
    assert {name: set(values.values()) for name, values in read.items()} == {k: {v} for k, v in want.items()}, read
    assert len(read["block_size"]) == 9


def test_simulates_own_flags_default_to_its_cluster_spec():
    actions = _actions("simulate")
    spec = ClusterSpec()
    own = {"max_num_seqs": "max_num_seqs", "prefill_budget": "prefill_budget", "decode_budget": "decode_budget",
           "transfer_failure_rate": "transfer_failure_rate", "role_switch_s": "role_switch_s", "tp": "tp",
           "mode": "mode", "prefill": "num_prefill", "decode": "num_decode", "instances": "num_instances"}
    assert {dest: actions[dest].default for dest in own} == {dest: getattr(spec, f) for dest, f in own.items()}
    assert actions["link_latency_us"].default * 1e-6 == pytest.approx(spec.link_latency_s)
    assert actions["control_latency_ms"].default * 1e-3 == spec.control_latency_s


def test_a_bad_batch_or_block_setting_is_a_one_line_error_before_any_model_loads():
    for kwargs, message in (({"block_size": 0}, "block_size must be positive, got 0"),
                            ({"num_kv_blocks": -1}, "num_kv_blocks must be positive, got -1"),
                            ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer, got 0"),
                            ({"queue_policy": "lifo"}, "unknown queue policy 'lifo'")):
        with pytest.raises(InvalidRequestError, match=message):
            EngineConfig(**kwargs)
    with pytest.raises(InvalidRequestError, match="block_size must be positive"):
        ClusterSpec(block_size=0)
