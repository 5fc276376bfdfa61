"""The layer rules, read from the import statements of every module (no import runs):

- the domain never imports the HTTP layers: only the wiring (app, cli, openapi, demo), the
  routers themselves and the operator console (which validates its forms with the API's
  own bodies) import `service.http.api`, and only the wiring imports `service.http.console`;
- the service never imports tests, bench or the drills (`sweeper drill` reaches the drills
  through the `sweeper.commands` entry point);
- bench and the drills never import tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

WIRING = frozenset({"service/app.py", "service/commands/cli.py", "service/commands/openapi.py",
                    "service/commands/demo.py"})


def modules(folder: str) -> list[Path]:
    return sorted((REPO_ROOT / folder).rglob("*.py"))


def imported(path: Path) -> set[str]:
    """Every module name an import statement of `path` names, at any depth."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def offending(paths: list[Path], *prefixes: str, allowed: frozenset[str] = frozenset()
              ) -> dict[str, list[str]]:
    """Modules (outside `allowed`) importing something under one of `prefixes`."""
    found = {}
    for path in paths:
        name = path.relative_to(REPO_ROOT).as_posix()
        if name in allowed:
            continue
        bad = sorted(n for n in imported(path)
                     if any(n == p or n.startswith(p + ".") for p in prefixes))
        if bad:
            found[name] = bad
    return found


def test_the_domain_never_imports_the_http_layers() -> None:
    domain = [p for p in modules("service")
              if not {"api", "console"} & set(p.relative_to(REPO_ROOT).parts)]
    assert offending(domain, "service.http.api", "service.http.console", allowed=WIRING) == {}
    api = [p for p in modules("service") if "api" in p.relative_to(REPO_ROOT).parts]
    assert offending(api, "service.http.console") == {}


def test_the_service_never_imports_tests_bench_or_drills() -> None:
    assert offending(modules("service"), "tests", "bench", "drills") == {}


@pytest.mark.parametrize("folder", ["bench", "drills"])
def test_bench_and_drills_never_import_tests(folder: str) -> None:
    assert offending(modules(folder), "tests") == {}


def test_the_rules_see_imports_at_any_depth(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tests.fakes import upstream\n    import bench.drain\n")
    assert imported(module) >= {"tests.fakes", "tests.fakes.upstream", "bench.drain"}


@pytest.mark.parametrize("folder", ["bench", "drills"])
def test_bench_and_drills_never_start_test_modules(folder: str) -> None:
    # a process started as `python -m tests.x` depends on tests as much as an import does
    starting = {p.relative_to(REPO_ROOT).as_posix() for p in modules(folder)
                if '"-m", "tests.' in p.read_text()}
    assert starting == set()
