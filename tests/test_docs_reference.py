"""The documentation site (issue 44 items 1 and 2): the reference pages committed in docs/reference/ are what
`python -m pdserve.docs_ref` writes from the code now (a flag, metric or path added or removed without
regenerating fails here), each page agrees with the running code by a second route (argparse's own --help, the
gateway's real /metrics answer, the app's routes), every environment variable the code reads is documented,
and `mkdocs build --strict` (as `make docs`) builds the site with no broken link or page. No model is loaded."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import docs_ref

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"


@pytest.mark.parametrize("name", sorted(docs_ref.PAGES))
def test_committed_reference_page_is_what_the_code_generates(name):
    committed = (REFERENCE / name).read_text()
    assert committed == docs_ref.PAGES[name](), (
        f"docs/reference/{name} differs from the code: run `.venv/bin/python -m pdserve.docs_ref` and commit it")


def test_check_mode_reports_stale_pages(tmp_path, capsys):
    assert docs_ref.main(["--check", "--out", str(tmp_path)]) == 1  # nothing there yet: all stale
    assert "cli.md" in capsys.readouterr().err and not list(tmp_path.iterdir())  # --check writes nothing
    assert docs_ref.main(["--out", str(tmp_path)]) == 0
    assert docs_ref.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "metrics.md").write_text((tmp_path / "metrics.md").read_text().replace("pdserve_fallbacks", "x"))
    assert docs_ref.main(["--check", "--out", str(tmp_path)]) == 1


FLAG = r"(?<![\w-])--[a-z0-9][a-z0-9-]*"


def _sections(page: str) -> dict[str, str]:
    """`## \\`pdserve X\\`` heading -> the text under it."""
    parts = re.split(r"^## `(pdserve[^`]*)`\n", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _subparsers(parser, words=("pdserve",)):
    for action in parser._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):
            for name, sub in action.choices.items():
                yield " ".join((*words, name)), sub
                yield from _subparsers(sub, (*words, name))


def test_cli_page_lists_every_flag_that_help_prints():
    from pdserve.cli import build_parser
    sections = _sections((REFERENCE / "cli.md").read_text())
    commands = dict(_subparsers(build_parser()))
    assert set(sections) == set(commands)
    for command, parser in commands.items():
        usage = set(re.findall(FLAG, parser.format_usage())) - {"--help"}  # each flag's first spelling; --x | --no-x
        rows = [line.split("|")[1] for line in sections[command].splitlines() if line.startswith("| `")]
        listed = {flag for row in rows for flag in (re.findall(FLAG, row) if " / " in row else re.findall(FLAG, row)[:1])}
        assert listed == usage, f"{command}: only in its usage {sorted(usage - listed)}, only on the page " \
                                f"{sorted(listed - usage)}"


class _Gateway:
    """What the /metrics handler reads of a gateway: its metrics."""

    def __init__(self) -> None:
        from pdserve.server.metrics import Metrics
        self.metrics = Metrics()


def test_metrics_page_lists_exactly_what_the_metrics_endpoint_exports():
    from fastapi.testclient import TestClient

    from pdserve.server.api import create_app
    text = TestClient(create_app(_Gateway())).get("/metrics").text
    families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))
    created = {name for name in families if name.endswith("_created")
               and {name.removesuffix("_created"), name.removesuffix("_created") + "_total"} & set(families)}
    exported = {name: kind for name, kind in families.items() if name not in created}  # (the page says NAME_created)
    page = (REFERENCE / "metrics.md").read_text()
    listed = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(pdserve_\w+)` \| (\w+) \|", page, flags=re.M)}
    assert len(exported) > 50 and "NAME_created" in page
    assert listed == exported


def test_http_page_lists_every_route_of_the_app():
    from fastapi.routing import APIRoute

    from pdserve.server.api import create_app
    routes = {f"{m} {r.path}" for r in create_app(None).routes if isinstance(r, APIRoute) for m in r.methods}
    page = (REFERENCE / "http-api.md").read_text()
    listed = set(re.findall(r"^### `([A-Z]+ /[^`]*)`$", page, flags=re.M))
    assert "POST /v1/chat/completions" in routes and listed == routes


def test_configuration_page_names_every_environment_variable_the_code_reads():
    used = {v for f in (ROOT / "pdserve").rglob("*.py") for v in re.findall(r"PDSERVE_[A-Z0-9_]*[A-Z0-9]", f.read_text())}
    page = (REFERENCE / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `(PDSERVE_[A-Z0-9_]+)` \|", page, flags=re.M))
    assert "PDSERVE_DEPLOYMENT_SECRET" in used
    assert used == documented, f"undocumented: {sorted(used - documented)}; gone: {sorted(documented - used)}"


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install 'pdserve[docs]'): site not built")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install 'pdserve[docs]')")
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    for page in ("index.html", "getting-started/index.html", "reference/cli/index.html",
                 "reference/metrics/index.html", "reference/http-api/index.html", "benchmarks/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
