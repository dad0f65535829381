"""The pure-Python layers (core scheduling, tokenizer, detokenizer, engine loop, model config, workloads and the
benchmark metrics) never load torch; and the dependency rule of ARCHITECTURE.md ("Layers and the dependency
rule"), checked statically over every import (module level or inside a function): no package imports one
above it, no import cycles, the pure layers (core, the conductor's decisions, the simulator) import no I/O
driver, event loop, wall clock or torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pdserve

PKG = Path(pdserve.__file__).resolve().parent
MODULES = ["pdserve", "pdserve.core", "pdserve.core.sched.scheduler", "pdserve.tokenizer", "pdserve.engine.detokenizer",
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
    assert _loaded_after_import(["pdserve.cli", "pdserve.server.serve", "pdserve.server.launch",
                                 "pdserve.server.app_runtime", "pdserve.model.loader"]) == set()


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


# The dependency rule, statically. A package is a directory under pdserve/ or a top-level module
# (`pdserve.errors` -> "errors"; the package's own __init__ is "__init__").
LAYERS = [  # bottom to top: a module imports its own package and packages of lower layers only
    {"errors", "cbuild", "paging", "version", "flags", "mooncake"},  # leaves: they import nothing of pdserve
    {"core", "workloads", "tokenizer"},  # pure Python: scheduling and the KV books; traces; the tokenizer
    {"bench"},  # load generator, metrics, reports (a client of any endpoint: core and workloads only)
    {"model"},  # the model runtime (torch)
    {"kv", "transfer"},  # the KV store's tensors (device, host, disk, codecs); bytes on links
    {"engine", "conductor"},  # the engine loop, the prefill/decode engines; the conductor's decisions (pure)
    {"worker"},  # the worker process: its loop, commands, reports (an engine under the conductor's commands)
    {"server", "sim"},  # the gateway, its conductor driver, launchers; the simulator (same conductor, engine)
    {"cli", "__init__"},  # the command line; the package's facade (`pdserve.LLM`, loaded lazily)
    {"docs_ref"},  # the reference pages generated from the command line, the metrics and the app (docs/reference)
]
WALL_CLOCK = {"time", "datetime"}
IO_AND_TORCH = {"asyncio", "zmq", "msgpack", "torch"}
# What ConductorCore's decisions use, found from its imports (the closure below), not listed by hand; this is
# the part that must be found, so that the rule is known to cover it.
CONDUCTOR_CORE = "pdserve.conductor.conductor_core"
CONDUCTOR_PARTS = {f"pdserve.conductor.{m}" for m in ("admission", "routing", "recovery", "membership", "staging",
                                                    "flight_state", "actions", "consumption", "hot_prefixes")}
GATEWAY_DRIVER = "pdserve.server.conductor_driver"  # the conductor over ZeroMQ and asyncio: never the simulator's
# Known exceptions, each (importer, imported): why. None today; one added here says why and for how long.
KNOWN_EDGES: dict[tuple[str, str], str] = {}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path, module: str, modules: set[str]) -> dict[str, list[int]]:
    """Every name `path` imports -> its lines: `import a.b`, `from a import b` (a.b when that is a module),
    relative imports resolved, and `importlib.import_module("a")` / `__import__("a")` with a literal name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        found = []
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            fn_name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            found = [str(node.args[0].value)] if fn_name in ("__import__", "import_module") else []
        for name in found:
            names.setdefault(name, []).append(node.lineno)
    return names


def scan(root: Path) -> dict[str, dict[str, list[int]]]:
    """{module: {imported name: lines}} for every source file of the package at `root`."""
    files = {_module_name(f, root): f for f in sorted(root.rglob("*.py"))}
    return {m: _imported_names(f, m, set(files)) for m, f in files.items()}


def internal_graph(imports: dict[str, dict[str, list[int]]]) -> dict[str, dict[str, list[int]]]:
    """Module -> the package's modules it imports (a name resolves to the longest module it starts with). The
    packages around an imported module, whose __init__ runs first, are not counted: each is a module too."""
    graph: dict[str, dict[str, list[int]]] = {}
    for module, names in imports.items():
        graph[module] = {}
        for name, lines in names.items():
            target = name
            while target and target not in imports:
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].setdefault(target, []).extend(lines)
    return graph


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations(graph, layers, known=()) -> list[str]:
    """Imports of a package in the same or a higher layer (siblings do not import each other either), and
    packages with no layer."""
    rank = {package: i for i, layer in enumerate(layers) for package in layer}
    out = [f"{m}: package {package_of(m)!r} has no layer" for m in graph if package_of(m) not in rank]
    for module, targets in graph.items():
        mine = package_of(module)
        for target, lines in targets.items():
            theirs = package_of(target)
            if theirs != mine and rank.get(theirs, -1) >= rank.get(mine, -1) and (module, target) not in known:
                out.append(f"{module} imports {target} (line {lines[0]}): {theirs} is not below {mine}")
    return out


def import_cycles(graph, known=()) -> list[list[str]]:
    """Strongly connected sets of two or more modules (Tarjan), after dropping the known edges."""
    edges = {m: [t for t in ts if (m, t) not in known] for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def reached(graph, roots, known=()) -> set[str]:
    """The modules `roots` import, directly or not (lazy imports count)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(t for t in graph.get(m, ()) if (m, t) not in known)
    return seen


def banned_imports(imports, modules, banned: set[str]) -> list[str]:
    """`module imports x` for each of `modules` whose imports name a top-level package in `banned`."""
    return [f"{m} imports {name} (line {lines[0]})" for m in sorted(modules)
            for name, lines in imports[m].items() if name.split(".")[0] in banned]


IMPORTS = scan(PKG)
GRAPH = internal_graph(IMPORTS)
KNOWN = set(KNOWN_EDGES)


def test_every_package_has_a_layer_and_imports_only_below_it():
    assert layer_violations(GRAPH, LAYERS, KNOWN) == []


def test_no_import_cycles():
    assert import_cycles(GRAPH, KNOWN) == []


def test_known_exceptions_are_still_there():
    # a known exception that was fixed is taken off the list
    assert [edge for edge in KNOWN_EDGES if edge[1] not in GRAPH.get(edge[0], {})] == []


def _pure_modules() -> set[str]:
    """core and the conductor: every module core, the conductor package or ConductorCore reaches."""
    return reached(GRAPH, [m for m in GRAPH if package_of(m) in ("core", "conductor")] + [CONDUCTOR_CORE])


def test_core_and_the_conductor_core_use_no_io_event_loop_wall_clock_or_torch():
    pure = _pure_modules()
    assert CONDUCTOR_PARTS | {"pdserve.core.role_planner", "pdserve.core.sched.scheduler"} <= pure  # found, so covered
    assert {package_of(m) for m in pure} <= {"core", "conductor", "errors", "cbuild"}
    assert GATEWAY_DRIVER not in pure
    assert banned_imports(IMPORTS, pure, IO_AND_TORCH | WALL_CLOCK) == []


def test_the_simulator_uses_no_gateway_driver_zmq_asyncio_or_torch():
    own = {m for m in GRAPH if package_of(m) == "sim"}
    assert len(own) >= 10
    assert banned_imports(IMPORTS, own, IO_AND_TORCH) == []
    assert [m for m in own if GATEWAY_DRIVER in GRAPH[m] and (m, GATEWAY_DRIVER) not in KNOWN] == []
    # and nothing it reaches (the real conductor core, engine loop, tiers, bench's flags) needs them either
    # (asyncio aside: `pdserve bench`'s own flags, which simulate reuses, come with its HTTP load generator)
    everything = reached(GRAPH, own, KNOWN)
    assert GATEWAY_DRIVER not in everything
    assert banned_imports(IMPORTS, everything, {"zmq", "msgpack", "torch"}) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_each_rule_reports_what_breaks_it(tmp_path):
    """The checker over a small package that breaks every rule once."""
    root = _write(tmp_path / "fake", {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from fake.high import b\n",  # upward, and lazily
        "low/pure.py": "import time\nfrom datetime import datetime\nimport asyncio\n",
        "low/ok.py": "from . import pure\nx = 'import torch'\n",  # relative, sideways: fine
        "mid/__init__.py": "",
        "mid/c.py": "from fake.mid import d\n",
        "mid/d.py": "import importlib\ndef g():\n    return importlib.import_module('fake.mid.c')\n",  # a cycle
        "mid/e.py": "from fake.side.s import y\n",  # a sibling of the same layer
        "side/__init__.py": "",
        "side/s.py": "import zmq\ny = 1\n",
        "high/__init__.py": "",
        "high/b.py": "import torch\nfrom ..low import a\n",  # relative upward import resolves
        "orphan.py": "",  # a package with no layer
    })
    imports = scan(root)
    graph = internal_graph(imports)
    layers = [{"low"}, {"mid", "side"}, {"high", "__init__"}]
    violations = layer_violations(graph, layers)
    assert any(v.startswith("fake.low.a imports fake.high.b") for v in violations)
    assert any(v.startswith("fake.mid.e imports fake.side.s") for v in violations)
    assert "fake.orphan: package 'orphan' has no layer" in violations
    assert not any(v.startswith(("fake.low.ok", "fake.high.b")) for v in violations)  # down and sideways: fine
    assert len(violations) == 3
    assert layer_violations(graph, layers, known={("fake.low.a", "fake.high.b"), ("fake.mid.e", "fake.side.s")}) == [
        "fake.orphan: package 'orphan' has no layer"]
    assert sorted(import_cycles(graph)) == [["fake.high.b", "fake.low.a"], ["fake.mid.c", "fake.mid.d"]]
    assert import_cycles(graph, known={("fake.mid.d", "fake.mid.c"), ("fake.low.a", "fake.high.b")}) == []
    assert banned_imports(imports, {"fake.low.pure"}, WALL_CLOCK) == [
        "fake.low.pure imports time (line 1)", "fake.low.pure imports datetime (line 2)"]
    assert banned_imports(imports, {"fake.low.pure", "fake.low.ok"}, IO_AND_TORCH) == [
        "fake.low.pure imports asyncio (line 3)"]
    assert reached(graph, ["fake.mid.e"]) == {"fake.mid.e", "fake.side.s"}
    assert banned_imports(imports, reached(graph, ["fake.low.a"]), IO_AND_TORCH) == [
        "fake.high.b imports torch (line 1)"]  # found through what fake.low.a imports
