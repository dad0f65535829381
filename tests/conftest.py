"""Shared fixtures: tiny random-weight HF models written with transformers, and the default model."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_WEIGHTS_CACHE: list[str] = []


def pytest_configure(config):
    """One prepared-weights cache (`pdserve.model.weight_cache`) for the session's every load, in-process and in
    the servers it starts (they inherit the environment): the first load of a model and format prepares and
    writes it, the suite's other ~75 starts map it. Its own folder, not the user's cache, removed at the end; a
    cache the runner set (`$PDSERVE_WEIGHTS_CACHE`) is used as it is."""
    if not os.environ.get("PDSERVE_WEIGHTS_CACHE"):
        _WEIGHTS_CACHE.append(tempfile.mkdtemp(prefix="pdserve-weights-"))
        os.environ["PDSERVE_WEIGHTS_CACHE"] = _WEIGHTS_CACHE[0]


def pytest_unconfigure(config):
    for path in _WEIGHTS_CACHE:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop("PDSERVE_WEIGHTS_CACHE", None)


def assert_no_blocks_held(engine) -> None:
    """Every device block is free once the engine is idle and its copies to the host tier have finished
    (an offload holds its block until the copy is done, so it is counted as used until then)."""
    if engine.kv_io is not None:
        engine.kv_io.drain()
        engine.poll_kv()
        assert engine.tiers.num_ops_in_flight == 0
    assert engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pdserve.model.loader import resolve_model_dir
    return resolve_model_dir(None)


def make_tiny_model(out: Path, tokenizer_dir: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random-weight model of the given family, with the default model's tokenizer files."""
    import torch
    import transformers

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                  initializer_range=0.2)
    common.update(overrides)
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**common)).to(torch.float32).eval()
    if arch == "qwen2":  # biases start at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_dir) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)



COLLECT_AFTER_GROWTH_MIB = 256  # resident memory gained since the last collection that makes a module's end collect


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) // 1024


_collected_at_mib = [0]  # this process's resident memory right after the last collection


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (its module fixtures finalized): collect what its engines left in reference
    cycles and hand freed heap back to the system. Without it the suite's process kept every module's engines
    (a model and a KV pool each, ~2 GB) until a rare full collection, grew past 20 GB and was killed.
    Only once the process has grown by COLLECT_AFTER_GROWTH_MIB since the last collection: a full collection of
    the suite's heap takes ~0.2-1 s at each of ~120 modules, and most modules leave no engine behind (the garbage
    kept between collections stays under that growth)."""
    yield
    if nextitem is not None and nextitem.module is item.module:
        return
    try:
        if _rss_mib() - _collected_at_mib[0] < COLLECT_AFTER_GROWTH_MIB:
            return
    except OSError:  # (no /proc: collect every time, as before)
        pass
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # (not glibc)
        pass
    try:
        _collected_at_mib[0] = _rss_mib()
    except OSError:
        pass


def pytest_runtest_logfinish(nodeid, location):
    """PDSERVE_TEST_RSS_LOG=FILE: each test's id and this process's resident memory after it (MiB), to find
    what the suite's process keeps."""
    import os
    path = os.environ.get("PDSERVE_TEST_RSS_LOG")
    if path:
        with open(path, "a") as out:
            out.write(f"{_rss_mib()} {nodeid}\n")
