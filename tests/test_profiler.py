"""The profiler: the fit recovers known coefficients, and a real (tiny) engine yields a sane model."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.profiler import fit, run_profile


def test_fit_recovers_known_coefficients():
    pre = [{"kind": "prefill", "tokens": [t], "seconds": 0.01 + 2e-4 * t + 3e-8 * t * t} for t in (16, 64, 256, 1024)]
    dec = [{"kind": "decode", "batch": b, "context_sum": b * c, "seconds": 0.02 + 1e-6 * b * c + 5e-4 * b}
           for b in (1, 4, 16) for c in (64, 512)]
    got = fit(pre + dec)
    for (kind, want) in (("prefill", (0.01, 2e-4, 3e-8)), ("decode", (0.02, 1e-6, 5e-4))):
        for key, value in zip("abc", want):
            assert got[kind][key] == pytest.approx(value, rel=1e-6)


def test_profile_of_a_real_engine(tiny_llama_dir):
    result = run_profile(EngineConfig(model=str(tiny_llama_dir), num_threads=1, max_num_batched_tokens=256),
                         prefill_tokens=(16, 64, 256), decode_batches=(1, 4), decode_contexts=(16, 64))
    assert len([s for s in result["samples"] if s["kind"] == "prefill"]) == 3
    assert len([s for s in result["samples"] if s["kind"] == "decode"]) == 4
    assert all(s["seconds"] > 0 for s in result["samples"])
    p = result["prefill"]
    assert p["a"] + p["b"] * 256 + p["c"] * 256 ** 2 > 0
