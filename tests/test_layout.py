"""The package's layout (``docs/architecture.md``), checked on the source with ``ast``; nothing is executed, and
imports inside functions and under ``TYPE_CHECKING`` count like any other:

* no import circle between modules (a package's ``__init__.py`` is a module too);
* each folder imports only the folders ``ALLOWED`` lists for it (the layers of ``docs/architecture.md``);
* the framework-free core imports no Lightning, and only ``strategies/``, ``callbacks/`` and ``cli/`` import the
  Trainer (``lightning.pytorch``);
* files stay under 600 lines and functions under 80, so each can be read in one sitting.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_zero"

# What each part of the package may import of the others: the layers of docs/architecture.md, lowest first. A
# top-level module is its own part ("torch_compat"); "TOP" is the package's face (``__init__.py``, ``__main__.py``).
CORE = {
    "torch_compat": set(),
    "diagnostics": {"torch_compat"},
    "ops": {"diagnostics", "torch_compat"},
    "offload": {"ops", "diagnostics", "torch_compat"},
    "distributed": {"offload", "ops", "diagnostics", "torch_compat"},
    "pipeline": {"distributed", "offload", "ops", "diagnostics", "torch_compat"},
    "checkpoint": {"distributed", "offload", "ops", "diagnostics", "torch_compat"},
    "estimate": {"distributed", "offload", "ops", "diagnostics", "torch_compat"},
    "ds_config": {"estimate", "distributed", "offload", "ops", "diagnostics", "torch_compat"},
}
_ALL_CORE = set(CORE)
ALLOWED = {
    **CORE,
    "adapters": _ALL_CORE,
    "fabric": {"adapters"} | _ALL_CORE,
    "strategies": {"adapters"} | _ALL_CORE,
    "callbacks": {"adapters"} | _ALL_CORE,
    "cli": {"strategies", "fabric", "callbacks", "adapters", "TOP"} | _ALL_CORE,
    "TOP": {"strategies", "fabric", "callbacks", "adapters", "cli"} | _ALL_CORE,
}
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
TRAINER = ("lightning.pytorch", "pytorch_lightning")
TRAINER_SIDE = ("strategies", "callbacks", "cli", "TOP")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_statements(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, list[str]]]:
    """``(line, names)`` for every import statement in ``source`` (the text of ``module``), relative imports
    resolved; ``from X import a`` names ``X.a``, which is a submodule or else a name defined by ``X``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield node.lineno, [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield node.lineno, [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _modules(root: Path) -> dict[str, Path]:
    return {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def _part(module: str, root: Path) -> str:
    """The part of the package ``module`` belongs to: its folder, a top-level module's name, or ``"TOP"``."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "TOP"
    return parts[1]


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """``{module: {imported package module: line}}`` over the package under ``root``: each imported name resolved to
    the module that defines it (``from X import a`` is ``X.a`` when that is a module, else ``X``)."""
    modules = _modules(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        for line, names in import_statements(path.read_text(), module, path.name == "__init__.py"):
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    edges.setdefault(name, line)
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def layout_violations(root: Path = PACKAGE) -> list[str]:
    """``"file:line: imports X (rule)"`` for every import under ``root`` (a ``lightning_zero`` tree) that breaks a
    rule of the module docstring."""
    modules = _modules(root)
    found = []
    for module, path in modules.items():
        relative = path.relative_to(root).as_posix()
        part = _part(module, root)
        for line, names in sorted(import_statements(path.read_text(), module, path.name == "__init__.py")):
            for name in names:  # one report per statement: the first name that breaks a rule
                rule = None
                if _within(name, LIGHTNING):
                    if part in CORE:
                        rule = f"{part}/ is framework-free: it imports no Lightning"
                    elif _within(name, TRAINER) and part not in TRAINER_SIDE:
                        rule = "only strategies/, callbacks/, cli/ import the Trainer"
                elif name.startswith("lightning_zero."):
                    target = name
                    while target and target not in modules:
                        target = target.rpartition(".")[0]
                    other = _part(target, root) if target else None
                    if other is not None and other != part and other not in ALLOWED.get(part, set()):
                        rule = f"{part} may not import {other}"
                if rule is not None:
                    found.append(f"{relative}:{line}: imports {name} ({rule})")
                    break
    return found


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert cycles == [], "import circles (move the shared piece down instead): " + "; ".join(" <-> ".join(c)
                                                                                           for c in cycles)



def test_benchmarks_import_each_other_as_a_package_without_circles():
    """``benchmarks/`` is a package too (``benchmarks/README.md``): its modules name each other ``benchmarks.X``,
    never by the bare file name a script's folder on ``sys.path`` would allow (the one exception: ``_path``, the
    bootstrap of a script run by path), so the graph below sees every edge, and it has no circle."""
    root = PACKAGE.parent / "benchmarks"
    siblings = {path.stem for path in root.glob("*.py")} - {"_path"}
    bare = [f"{path.name}:{line}: {name}" for path in sorted(root.rglob("*.py"))
            for line, names in import_statements(path.read_text(), _module_name(path, root))
            for name in names if name.partition(".")[0] in siblings]
    assert bare == [], "import these as benchmarks.X: " + "; ".join(bare)
    cycles = import_cycles(import_graph(root))
    assert cycles == [], "import circles among the benchmarks: " + "; ".join(" <-> ".join(c) for c in cycles)

def test_package_follows_the_layout():
    assert PACKAGE.joinpath("fabric").is_dir() and PACKAGE.joinpath("distributed", "runtime.py").is_file()
    assert layout_violations() == []


def test_every_part_is_in_the_layout():
    # a new folder (or top-level module) must be given its place in ALLOWED and in docs/architecture.md
    parts = {_part(module, PACKAGE) for module in _modules(PACKAGE)}
    assert parts <= set(ALLOWED), sorted(parts - set(ALLOWED))
    documented = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [part for part in parts - {"TOP"} if not re.search(rf"`{part}/?`", documented)]
    assert missing == [], missing


def test_files_and_functions_stay_short():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        where = path.relative_to(PACKAGE).as_posix()
        if len(source.splitlines()) > MAX_FILE_LINES:
            long.append(f"{where}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{where}:{node.lineno}: {node.name} is {length} lines")
    assert long == [], "split along a seam a reader would name: " + "; ".join(long)


ADAPTERS = ("strategies/trainer_strategy.py", "fabric/fabric_strategy.py")
MAX_ADAPTER_LINES = 350


def test_the_adapters_stay_thin():
    # An adapter is a list of calls into the runtime and the adapter helpers (docs/architecture.md): logic that grows
    # in one belongs in adapters/runtime_steps.py, strategies/trainer_steps.py or a fabric/ module.
    lengths = {name: len((PACKAGE / name).read_text().splitlines()) for name in ADAPTERS}
    assert all(length <= MAX_ADAPTER_LINES for length in lengths.values()), lengths


@pytest.mark.parametrize(("relative", "source", "rule"), [
    ("fabric/x.py", "from lightning_zero.strategies.trainer_precision import ZeroPrecision", "fabric may not import"),
    ("fabric/x.py", "def f():\n    from ..strategies import trainer_strategy\n", "fabric may not import"),
    ("fabric/x.py", "from lightning_zero import strategies", "fabric may not import strategies"),
    ("strategies/x.py", "from lightning_zero.fabric import fabric_strategy", "strategies may not import fabric"),
    ("distributed/x.py", "import lightning.fabric", "framework-free"),
    ("checkpoint/x.py", "def f():\n    from lightning_fabric.utilities import rank_zero\n", "framework-free"),
    ("distributed/x.py", "from lightning_zero.adapters import settings", "distributed may not import adapters"),
    ("distributed/x.py", "from lightning_zero.checkpoint import io", "distributed may not import checkpoint"),
    ("ops/x.py", "from lightning_zero.distributed import optimizer", "ops may not import distributed"),
    ("fabric/x.py", "def f():\n    from lightning.pytorch import LightningModule\n", "import the Trainer"),
    ("adapters/x.py", "import pytorch_lightning", "import the Trainer"),
    ("pipeline/x.py", "from lightning_zero.callbacks import ThroughputLogger", "pipeline may not import callbacks"),
])
def test_each_rule_catches_its_violation(tmp_path, relative, source, rule):
    root = tmp_path / "lightning_zero"
    path = root / relative
    path.parent.mkdir(parents=True)
    path.write_text(source)
    for module in ("strategies/__init__.py", "strategies/trainer_precision.py", "strategies/trainer_strategy.py",
                   "fabric/fabric_strategy.py",
                   "adapters/settings.py", "checkpoint/io.py", "distributed/optimizer.py", "callbacks/__init__.py"):
        (root / module).parent.mkdir(parents=True, exist_ok=True)
        (root / module).touch()
    found = layout_violations(root)
    assert len(found) == 1 and rule in found[0], found


@pytest.mark.parametrize(("relative", "source"), [
    ("fabric/x.py", "from lightning.fabric.plugins.precision import Precision\nfrom lightning_zero.adapters import y"),
    ("strategies/x.py", "from lightning.pytorch import Trainer\nfrom lightning_zero.adapters import y"),
    ("distributed/x.py", "import torch\nfrom lightning_zero.ops import loss_scaler"),
    ("checkpoint/x.py", "from lightning_zero.distributed import optimizer"),
])
def test_allowed_directions_pass(tmp_path, relative, source):
    root = tmp_path / "lightning_zero"
    for module in (relative, "adapters/y.py", "ops/loss_scaler.py", "distributed/optimizer.py"):
        (root / module).parent.mkdir(parents=True, exist_ok=True)
    (root / relative).write_text(source)
    for module in ("adapters/y.py", "ops/loss_scaler.py", "distributed/optimizer.py"):
        (root / module).touch()
    assert layout_violations(root) == []


def test_a_cycle_is_found_even_through_an_import_inside_a_function(tmp_path):
    root = tmp_path / "lightning_zero"
    (root / "distributed").mkdir(parents=True)
    (root / "distributed" / "a.py").write_text("from lightning_zero.distributed.b import g\n")
    (root / "distributed" / "b.py").write_text("def g():\n    from lightning_zero.distributed import a\n")
    (root / "distributed" / "c.py").write_text("import lightning_zero.distributed.a\n")
    assert import_cycles(import_graph(root)) == [["lightning_zero.distributed.a", "lightning_zero.distributed.b"]]
