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
from pdserve.core.settings import (AdmissionSettings, CadenceSettings, CodecSettings, DeliverySettings,
                                   KvTierSettings, RoutingSettings, SupervisionSettings, default_of)
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import InvalidRequestError
from pdserve.server.launch import ServeConfig
from pdserve.sim.cluster import SIM_KV_TIERS, ClusterSpec
from pdserve.sim.engine import SimEngine

SLICES = (DeliverySettings, AdmissionSettings, CadenceSettings, KvTierSettings, CodecSettings, SupervisionSettings,
          RoutingSettings)
# Which settings each command takes (the rest of a slice is not that command's setting).
COMMANDS = {
    "serve": {s: {f.name for f in dataclasses.fields(s)} for s in SLICES},
    "worker": {SupervisionSettings: {"kv_timeout_s", "drain_timeout_s"},
               DeliverySettings: {"delivery", "delivery_backlog_s"}, CadenceSettings: {"decode_cadence"},
               KvTierSettings: {"kv_host_gb", "kv_disk_gb", "kv_eviction_policy"}, CodecSettings: {"kv_cache_dtype"}},
    "simulate": {DeliverySettings: {f.name for f in dataclasses.fields(DeliverySettings)},
                 AdmissionSettings: {"admission", "admission_margin"}, CadenceSettings: {"decode_cadence"},
                 KvTierSettings: {"kv_host_gb", "kv_disk_gb", "kv_eviction_policy"}, CodecSettings: {"kv_cache_dtype"},
                 RoutingSettings: {f.name for f in dataclasses.fields(RoutingSettings)}},
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
            assert action.help == _field(slice_cls, name).metadata["help"] + old, name
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
    with pytest.raises(InvalidRequestError, match="eviction"):
        EngineConfig(kv_eviction_policy="fifo")
    with pytest.raises(InvalidRequestError, match="eviction"):
        ClusterSpec(kv_eviction_policy="fifo")
