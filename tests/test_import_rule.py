"""The pure-Python layers (core scheduling, tokenizer, detokenizer, engine loop, model config, workloads and the
benchmark metrics) never load torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pdserve

PKG = Path(pdserve.__file__).resolve().parent
MODULES = ["pdserve", "pdserve.core", "pdserve.core.scheduler", "pdserve.tokenizer", "pdserve.engine.detokenizer",
           "pdserve.engine.llm_engine", "pdserve.model.config", "pdserve.workloads", "pdserve.bench.metrics",
           "pdserve.sim", "pdserve.sim.cluster", "pdserve.sim.cli", "pdserve.sim.plan", "pdserve.sim.report"]
PURE_PACKAGES = ["workloads", "bench", "sim"]  # every source file under these is checked statically, like core


def _loaded_after_import(modules: list[str]) -> set[str]:
    code = (f"import sys\nimport {', '.join(modules)}\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=PKG.parent)
    assert res.returncode == 0, res.stderr
    return set(res.stdout.split())


def test_pure_modules_do_not_import_torch():
    assert _loaded_after_import(MODULES) == set()


def test_the_gateway_process_does_not_import_torch():
    # it only resolves the model directory and routes: importing torch would add seconds to every start
    assert _loaded_after_import(["pdserve.cli", "pdserve.server.launch", "pdserve.server.app_runtime",
                                 "pdserve.model.loader"]) == set()


def test_the_subprocess_check_can_see_torch():
    # Guard for the test above: importing a module that does need torch is detected.
    assert "torch" in _loaded_after_import(["pdserve.kv.device_pool"])


def _torch_imports(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            fn_name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            names = [str(node.args[0].value)] if fn_name in ("__import__", "import_module") else []
        else:
            continue
        if any(n == "torch" or n.startswith("torch.") for n in names):
            lines.append(node.lineno)
    return lines


def _offenders(files: list[Path]) -> dict[str, list[int]]:
    return {str(f.relative_to(PKG)): lines for f in files if (lines := _torch_imports(f))}


def test_core_sources_never_import_torch():
    files = sorted((PKG / "core").rglob("*.py"))
    assert len(files) >= 8
    assert _offenders(files) == {}


def test_workload_and_bench_sources_never_import_torch():
    files = sorted(f for pkg in PURE_PACKAGES for f in (PKG / pkg).rglob("*.py"))
    assert {"workloads/loader.py", "workloads/prompts.py", "bench/metrics.py", "sim/engine.py"} <= {
        str(f.relative_to(PKG)) for f in files}
    assert _offenders(files) == {}


def test_static_check_detects_torch_imports(tmp_path):
    for src in ["import torch", "import os, torch.nn as nn", "from torch import nn", "from torch.nn import functional",
                "def f():\n    import torch", "import importlib\nimportlib.import_module('torch')", "__import__('torch')"]:
        f = tmp_path / "m.py"
        f.write_text(src + "\n")
        assert _torch_imports(f), src
    (tmp_path / "ok.py").write_text('"""Never imports torch."""\nimport torchvision_like_name as t\nx = "torch"\n')
    assert _torch_imports(tmp_path / "ok.py") == []
