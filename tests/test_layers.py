"""The house's floors, held by import-linter (the contracts in pyproject.toml's [tool.importlinter]).

A contract checked by a kept tool rather than by hand: the package as it is keeps every
contract, and a copy of it with one upward import (``parallel`` importing ``training``) or one
cycle between siblings breaks it, so the check can fail. Beside it, the import graph built here
from every import statement (function-level ones too) holds no cycle of any kind.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import-linter's own command, run by this interpreter (its script may live outside the venv)
LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command as m; m()", "--no-cache"]


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(LINT, cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "repo"
    shutil.copytree(ROOT / "zerotron", dst / "zerotron", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_the_package_keeps_every_contract():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.mark.parametrize("module,line,contract", [
    ("parallel/grid.py", "import zerotron.training.trainer", "layers"),
    ("data/indexed.py", "import zerotron.model.gpt", "data stands beside"),
    ("activation/config.py", "import zerotron.activation.checkpoint", "no import cycles"),
])
def test_an_import_against_the_floors_breaks_a_contract(tmp_path, module, line, contract):
    repo = _copy(tmp_path)
    path = repo / "zerotron" / module
    path.write_text(path.read_text() + f"\n{line}  # injected by the test\n")
    run = _lint(repo)
    assert run.returncode != 0, run.stdout
    assert contract in run.stdout.split("Broken contracts")[-1], run.stdout


# No cycle at all, function-level imports counted ----------------------------------------------
# import-linter's "acyclic_siblings" sees function-level imports too, but only between siblings:
# a cycle that runs through a package's own __init__ (``zero/__init__`` -> ``zero.optimizer`` ->
# ... -> ``from zerotron.zero import X``) passes it. This graph is built from every import
# statement of every module, at any depth (inside functions and ``if TYPE_CHECKING`` included).
# Rule for packages: an import is an edge to the module it names -- ``zerotron.zero.config``, or
# the package ``zerotron.zero`` itself when it takes a name its ``__init__`` defines -- and not to
# the ancestor ``__init__`` files Python runs first. Those run before the child and never need
# it, so a package re-exporting its submodules is no cycle; a submodule taking a name from its
# package's ``__init__`` that imports it back is one (a partly initialised module at import time).
def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """zerotron's modules: dotted name -> (file, whether it is a package's __init__)."""
    files = {}
    for path in (root / "zerotron").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return files


def _imported(name: str, is_package: bool, source: str, files: dict) -> set[str]:
    """The zerotron modules that the import statements of ``source`` (module ``name``) name."""
    def module(dotted: str) -> str | None:  # the longest prefix of a dotted name that is a module
        while dotted and dotted not in files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    here, edges = (name if is_package else name.rpartition(".")[0]), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            edges.update(module(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb from this module's package
                anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{anchor}.{base}".rstrip(".")
            edges.update(module(f"{base}.{alias.name}") for alias in node.names)
    return {e for e in edges if e is not None and e != name}


def import_graph(root: Path = ROOT, added: tuple[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the modules it imports; ``added``: (file under zerotron/, source appended)."""
    files = _modules(root)
    graph = {}
    for name, (path, is_package) in files.items():
        source = path.read_text()
        if added is not None and path == root / "zerotron" / added[0]:
            source += "\n\n" + added[1] + "\n"
        graph[name] = _imported(name, is_package, source, files)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module: each module with the modules
    it both reaches and is reached from (~170 nodes: plain reachability will do)."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        reach[start] = seen
    cycles = {frozenset({m} | {o for o in reach[m] if m in reach[o]})
              for m in graph if m in reach[m]}
    return sorted(sorted(c) for c in cycles)


def test_no_import_cycle_among_zerotron_modules():
    graph = import_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # it read the package
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (function-level imports counted): " + "; ".join(
        " <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("module,line,cycle", [
    # the RNG helpers' old cycle, re-added as a function-level import (import-linter sees it too)
    ("activation/selective.py",
     "def _f():\n    from zerotron.activation.checkpoint import capture_rng",
     {"zerotron.activation.checkpoint", "zerotron.activation.selective"}),
    # through a package's __init__: import-linter's sibling contract passes this one
    ("zero/accounting.py", "def _f():\n    from zerotron.zero import ZeroOptimizer",
     {"zerotron.zero", "zerotron.zero.accounting", "zerotron.zero.optimizer"}),
    # the CLI and the DeepSpeed reader's old cycle over set_field, as a relative import
    ("config/deepspeed/__init__.py", "from ..cli import set_field",
     {"zerotron.config.cli", "zerotron.config.deepspeed"}),
    # ZeRO's strategies and ZeRO++'s over the factory
    ("zero/strategies.py",
     "def _f():\n    from zerotron.zero.zeropp.strategies import SecondaryGather",
     {"zerotron.zero.strategies", "zerotron.zero.zeropp.strategies"}),
])
def test_a_re_added_cycle_is_found(module, line, cycle):
    found = import_cycles(import_graph(added=(module, line)))
    assert any(cycle <= set(c) for c in found), found
