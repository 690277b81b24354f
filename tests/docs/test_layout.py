"""The package's layout (``docs/architecture.md``), checked on the source with ``ast``; nothing of it is executed, and
imports inside functions and under ``TYPE_CHECKING`` count like any other:

* no import circle between modules (a package's ``__init__.py`` is a module too);
* each folder imports only the folders ``ALLOWED`` lists for it (the layers of ``docs/architecture.md``);
* the framework-free core imports no Lightning, and only ``strategies/``, ``callbacks/`` and ``cli/`` import the
  Trainer (``lightning.pytorch``);
* files stay under 600 lines and functions under 80, so each can be read in one sitting;
* each top-level function, class and public constant is defined in one module only (``DEFINED_IN_EACH``: the names
  a convention asks several modules to define), and imported wherever else it is used;
* a ``[Note: ...]`` states an invariant and its reason: the figures measured for it live in ``docs/``, where the
  Note points (``NOTE_FIGURES``: the few figures that are invariants themselves).
* no module outside ``torch_compat/`` names a private torch module or attribute (``_``-prefixed, dunders aside):
  not in an import (``from torch.x import _y``, ``import torch.x._y``), not in an attribute chain rooted at a name
  bound by a torch import (``torch._foreach_mul_``, ``dist.distributed_c10d._get_default_store``), not as a
  ``getattr``-family string on such a chain, and not as one of the private attributes of the torch objects the
  package handles (``TORCH_PRIVATE_ATTRIBUTES``: a DTensor's ``_local_tensor``, an ``FSDPParam``'s
  ``_sharded_param_data``, a module's ``_forward_hooks``, ...) on any object but ``self``/``cls``/``super()``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_zero"

# What each part of the package may import of the others: the layers of docs/architecture.md, lowest first. Each
# folder is a part ("torch_compat" is the folder of torch internals); "TOP" is the package's face (``__init__.py``,
# ``__main__.py``).
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
# Names that several modules define on purpose, each for its own caller that reaches it through the module:
DEFINED_IN_EACH = {
    "ZeroStrategy": "the Trainer's and Fabric's strategy class, each registered under its framework's own name",
    "save": "each adapter's checkpoint module (trainer_checkpoints, fabric_checkpoints), called module-qualified",
    "load": "each adapter's checkpoint module, as save",
    "add_parser": "every cli/ subcommand module: cli.main registers each by its module name",
    "run": "every cli/ subcommand module: what cli.main runs for it",
    "main": "the entry point of each module run with python -m (cli, cli.advise_measure, cli.diagnose, fabric)",
    "log": "each module's own logger, logging.getLogger(__name__)",
}
# A measurement in a Note: a number with a unit of size, time or ratio, a percentage, a date, or the word "measured".
_NUMBER = r"\d(?:[\d.,]*\d)?"
MEASUREMENT = re.compile(
    rf"\bmeasured\b|{_NUMBER}(?:\s?[-–]\s?{_NUMBER})?\s?(?:[KMGT]i?B|ms|us|µs|ns|s|min|x|×)(?!\w)"
    r"|\d\s?%|\b20\d\d-\d\d-\d\d\b"
)
# Figures a Note may hold because they are invariants, not measurements: {Note title: {figure: why}}.
NOTE_FIGURES = {
    "buffers too large to pool": {"32 MiB": "glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, an allocator constant"},
}
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")
_LEAD = re.compile(r"""^\s*(?:#:?|[rRbBuU]?\"\"\"|[rR]?\'\'\')?\s*""")


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
                anchor = anchor[: len(anchor) - (node.level - 1)]
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
    assert cycles == [], "import circles (move the shared piece down instead): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_benchmarks_import_each_other_as_a_package_without_circles():
    """``benchmarks/`` is a package too (``benchmarks/README.md``): its modules name each other ``benchmarks.X``,
    never by the bare file name a script's folder on ``sys.path`` would allow (the one exception: ``_path``, the
    bootstrap of a script run by path), so the graph below sees every edge, and it has no circle."""
    root = PACKAGE.parent / "benchmarks"
    siblings = {path.stem for path in root.glob("*.py")} - {"_path"}
    bare = [
        f"{path.name}:{line}: {name}"
        for path in sorted(root.rglob("*.py"))
        for line, names in import_statements(path.read_text(), _module_name(path, root))
        for name in names
        if name.partition(".")[0] in siblings
    ]
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


def top_level_definitions(root: Path = PACKAGE) -> dict[str, list[str]]:
    """``{name: ["file:line", ...]}`` of the functions, classes and public constants (assigned names that do not start
    with ``_``) defined at the top level of each module under ``root``. Module-private constants are left out: no
    module reads another's private names, so each is read only in its own file."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name) and not t.id.startswith("_")]
            else:
                continue
            for name in names:
                found.setdefault(name, []).append(f"{where}:{node.lineno}")
    return found


def duplicate_definitions(root: Path = PACKAGE) -> list[str]:
    return [
        f"{name} in {', '.join(places)}"
        for name, places in top_level_definitions(root).items()
        if len(places) > 1 and name not in DEFINED_IN_EACH
    ]


def test_each_helper_is_defined_once():
    # Keep one definition in the lowest layer its users may import and import it elsewhere; two things that only
    # share a name get names that say how they differ.
    duplicates = duplicate_definitions()
    assert duplicates == [], "defined in more than one module: " + "; ".join(duplicates)


def test_a_second_definition_is_found(tmp_path):
    root = tmp_path / "lightning_zero"
    (root / "ops").mkdir(parents=True)
    (root / "checkpoint").mkdir()
    (root / "ops" / "a.py").write_text("def parse_size(text):\n    return 1\n_PRIVATE = 1\nLIMIT = 2\n")
    (root / "checkpoint" / "b.py").write_text(
        "class parse_size:\n    pass\n_PRIVATE = 3\nLIMIT: int = 4\ndef save():\n    pass\n"
    )
    (root / "checkpoint" / "c.py").write_text("from ..ops.a import parse_size\ndef save():\n    pass\n")
    assert duplicate_definitions(root) == [
        "parse_size in checkpoint/b.py:1, ops/a.py:1",
        "LIMIT in checkpoint/b.py:4, ops/a.py:4",
    ]


def _opens_a_note(line: str, start: int) -> bool:
    # a Note opens a docstring, a comment or a sentence; one named inside a sentence ("see [Note: ...]") is a reference
    before = _LEAD.sub("", line[:start], count=1).rstrip()
    return not before or before.endswith(".")


def note_blocks(source: str) -> Iterator[tuple[int, str, str]]:
    """``(line, title, text)`` of each Note ``source`` holds: from its ``[Note: title]`` to the next Note, the end of
    its docstring, or the end of its comment."""
    lines = source.splitlines()
    for number, line in enumerate(lines):
        for match in _NOTE.finditer(line):
            if not _opens_a_note(line, match.start()):
                continue
            text, rest = [], line[match.start() :]
            in_comment = line.lstrip().startswith("#")
            for following in lines[number + 1 :]:
                if '"""' in rest or (in_comment and not following.lstrip().startswith("#")):
                    break
                text.append(rest)
                opening = _NOTE.search(following)
                if opening and _opens_a_note(following, opening.start()):
                    rest = ""
                    break
                rest = following
            text.append(rest.partition('"""')[0])
            yield number + 1, match.group(1), "\n".join(text)


def note_measurements(root: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, title, text in note_blocks(path.read_text()):
            allowed = NOTE_FIGURES.get(title, {})
            figures = [m.group() for m in MEASUREMENT.finditer(text) if m.group() not in allowed]
            if figures:
                found.append(f"{path.relative_to(root).as_posix()}:{line}: [Note: {title}] holds {figures}")
    return found


def test_notes_state_invariants_not_measurements():
    # Move the figure to the docs page on the topic (with the command that measures it) and point the Note there.
    found = note_measurements()
    assert found == [], "measurements in Notes: " + "; ".join(found)


def test_a_measurement_in_a_note_is_found(tmp_path):
    root = tmp_path / "lightning_zero"
    root.mkdir()
    (root / "a.py").write_text(
        '"""Module.\n\n[Note: the unit]\nEight units keep the peak low (measured: 881 MiB).\n\n'
        'Still the note: 1.09x.\n"""\n'
        "# [Note: a comment note] one pass, 3 ms\n"
        "x = 1  # see [Note: the unit]: 5 MiB\n"
        "#: Seconds. [Note: an inline note] 300 s\ny = 2  # 40 ms\n"
        'def f():\n    """[Note: quiet] Bytes stay on the device."""\n'
        '"""[Note: buffers too large to pool] never above 32 MiB, while 2647 MiB was the peak."""\n'
    )
    assert note_measurements(root) == [
        "a.py:3: [Note: the unit] holds ['measured', '881 MiB', '1.09x']",
        "a.py:8: [Note: a comment note] holds ['3 ms']",
        "a.py:10: [Note: an inline note] holds ['300 s']",
        "a.py:14: [Note: buffers too large to pool] holds ['2647 MiB']",
    ]


ADAPTERS = ("strategies/trainer_strategy.py", "fabric/fabric_strategy.py")
MAX_ADAPTER_LINES = 350


def test_the_adapters_stay_thin():
    # An adapter is a list of calls into the runtime and the adapter helpers (docs/architecture.md): logic that grows
    # in one belongs in adapters/runtime_steps.py, strategies/trainer_steps.py or a fabric/ module.
    lengths = {name: len((PACKAGE / name).read_text().splitlines()) for name in ADAPTERS}
    assert all(length <= MAX_ADAPTER_LINES for length in lengths.values()), lengths


@pytest.mark.parametrize(
    ("relative", "source", "rule"),
    [
        (
            "fabric/x.py",
            "from lightning_zero.strategies.trainer_precision import ZeroPrecision",
            "fabric may not import",
        ),
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
    ],
)
def test_each_rule_catches_its_violation(tmp_path, relative, source, rule):
    root = tmp_path / "lightning_zero"
    path = root / relative
    path.parent.mkdir(parents=True)
    path.write_text(source)
    for module in (
        "strategies/__init__.py",
        "strategies/trainer_precision.py",
        "strategies/trainer_strategy.py",
        "fabric/fabric_strategy.py",
        "adapters/settings.py",
        "checkpoint/io.py",
        "distributed/optimizer.py",
        "callbacks/__init__.py",
    ):
        (root / module).parent.mkdir(parents=True, exist_ok=True)
        (root / module).touch()
    found = layout_violations(root)
    assert len(found) == 1 and rule in found[0], found


@pytest.mark.parametrize(
    ("relative", "source"),
    [
        (
            "fabric/x.py",
            "from lightning.fabric.plugins.precision import Precision\nfrom lightning_zero.adapters import y",
        ),
        ("strategies/x.py", "from lightning.pytorch import Trainer\nfrom lightning_zero.adapters import y"),
        ("distributed/x.py", "import torch\nfrom lightning_zero.ops import loss_scaler"),
        ("checkpoint/x.py", "from lightning_zero.distributed import optimizer"),
    ],
)
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


# Private attributes of the torch objects the package handles that live on instances (set in ``__init__`` or by
# C++), so no ``dir()`` of a class lists them; the private names on a tensor, a storage, a module and an optimizer
# are added from live objects below. ``reducer`` (DDP's C++ reducer) and FSDP2's fields below are unprefixed, but
# internal all the same.
TORCH_INSTANCE_ATTRIBUTES = frozenset(
    {
        "_local_tensor",
        "_spec",  # DTensor
        "_get_fsdp_state",
        "_fsdp_param_group",
        "_fsdp_param_groups",
        "_training_state",
        "_pre_forward",
        "_post_forward",
        "_post_forward_hook_handle",
        "_sharded_param_data",
        "_unsharded_param",
        "_all_gather_result",
        "_module_info",  # FSDP2's FSDPModule, FSDPState, FSDPParamGroup, FSDPParam
        "fsdp_params",
        "sharded_param",
        "padded_sharded_param_size",
        "fsdp_placement",  # their unprefixed fields ([Note: FSDP2's unprefixed internals])
        "reducer",
        "_rebuild_buckets",
        "_has_rebuilt_buckets",  # DDP
        "_module_classes",  # ModuleWrapPolicy
        "_schema",  # OpOverload
        "_get_init_p2p_neighbors_ops",  # PipelineStage
        "_wrapped_by_lr_sched",
        "_opt_called",  # LRScheduler's step wrapper and its record on the optimizer
    }
)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private_attributes() -> frozenset:
    import torch
    from torch import nn

    parameter = nn.Parameter(torch.zeros(1))
    live = (parameter, parameter.untyped_storage(), nn.Linear(1, 1), torch.optim.SGD([parameter], lr=0.1))
    return TORCH_INSTANCE_ATTRIBUTES | {name for obj in live for name in dir(obj) if _private(name)}


TORCH_PRIVATE_ATTRIBUTES = _torch_private_attributes()
GETATTR_FAMILY = ("getattr", "hasattr", "setattr", "delattr")


def _torch_names(tree: ast.AST) -> tuple[set[str], list[tuple[int, str]]]:
    """The names a torch import binds in ``tree`` (``import torch.x as y``: ``y``; ``from torch.x import z``:
    ``z``), and ``(line, text)`` for each of those imports that names a private module or object."""
    names, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _within(alias.name, ("torch",)):
                    names.add(alias.asname or "torch")
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and not node.level and _within(node.module or "", ("torch",)):
            for alias in node.names:
                names.add(alias.asname or alias.name)
                if any(_private(part) for part in [*node.module.split("."), alias.name]):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
    return names, found


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _own(node: ast.AST) -> bool:
    """Whether ``node`` (an attribute's receiver) is the object's own class speaking: ``self``, ``cls``, ``super()``."""
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id == "super"
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` for each place ``source`` names a private torch module or attribute (the last rule of the
    module docstring)."""
    tree = ast.parse(source)
    roots, found = _torch_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            rooted = isinstance(_root(node), ast.Name) and _root(node).id in roots
            if rooted or (node.attr in TORCH_PRIVATE_ATTRIBUTES and not _own(node.value)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr in TORCH_INSTANCE_ATTRIBUTES and not _own(node.value):
            found.append((node.lineno, ast.unparse(node)))  # unprefixed internals (DDP's reducer)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in GETATTR_FAMILY
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            rooted = isinstance(_root(node.args[0]), ast.Name) and _root(node.args[0]).id in roots
            if rooted or (node.args[1].value in TORCH_PRIVATE_ATTRIBUTES and not _own(node.args[0])):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def private_torch_violations(root: Path = PACKAGE) -> list[str]:
    """``"file:line: text"`` for every private torch name used under ``root`` outside ``torch_compat``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.split("/")[0] in ("torch_compat", "torch_compat.py"):
            continue
        found.extend(f"{relative}:{line}: {text}" for line, text in private_torch_uses(path.read_text()))
    return found


def test_private_torch_names_live_in_torch_compat():
    found = private_torch_violations()
    assert found == [], "name each through lightning_zero.torch_compat (with why and a test): " + "; ".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "from torch.utils._pytree import tree_flatten",
        "from torch.distributed.fsdp import _fully_shard",
        "import torch.distributed.checkpoint._nested_dict",
        "import torch\ntorch._foreach_mul_([], 2.0)",
        "import torch\nf = torch._utils._rebuild_tensor_v2",
        "import torch.distributed as dist\ndist.distributed_c10d._get_default_store()",
        "from torch import serialization\nserialization._open_zipfile_writer('x')",
        "import torch\ngetattr(torch.storage, '_dtype_to_storage_type_map')",
        "def f(param):\n    return param._local_tensor",
        "def f(module):\n    return module._get_fsdp_state()",
        "def f(fsdp_param):\n    return getattr(fsdp_param, '_sharded_param_data', None)",
        "def f(module):\n    return module._forward_hooks",
        "def f(tensor):\n    return tensor._version",
        "def f(ddp):\n    ddp.reducer.prepare_for_backward([])",
    ],
)
def test_each_private_torch_spelling_is_caught(source):
    assert len(private_torch_uses(source)) >= 1, source


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.distributed.checkpoint.save",
        "import torch\nx = torch.zeros(1).__class__",
        "class A:\n    def f(self):\n        return self._local_tensor, super()._apply(None)",
        "def f(trainer):\n    return trainer._checkpoint_connector",  # Lightning's, not torch's
        "import os\nos._exit(0)",
    ],
)
def test_public_and_non_torch_names_pass(source):
    assert private_torch_uses(source) == []


def test_private_torch_names_are_allowed_inside_torch_compat(tmp_path):
    root = tmp_path / "lightning_zero"
    (root / "torch_compat").mkdir(parents=True)
    (root / "ops").mkdir()
    (root / "torch_compat" / "ops.py").write_text("import torch\nforeach_mul_ = torch._foreach_mul_\n")
    (root / "ops" / "adam.py").write_text("import torch\ntorch._foreach_mul_([], 2.0)\n")
    assert private_torch_violations(root) == ["ops/adam.py:2: torch._foreach_mul_"]
