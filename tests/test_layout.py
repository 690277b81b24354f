"""The import direction of ``/work/shared/design/layout.md``, checked on the source with ``ast`` (imports inside
functions count too; nothing is executed):

* ``fabric/`` (the Fabric adapter and the helpers both adapters share) never imports ``lightning_zero.strategies``
  (the Trainer adapter), which builds on it;
* the framework-free core (``distributed/``, ``offload/``, ``diagnostics/``, ``checkpoint/``) imports no Lightning
  at all, neither directly nor through the adapter packages;
* nothing outside ``strategies/``, ``callbacks/``, ``cli/`` imports Lightning's Trainer (``lightning.pytorch``,
  ``pytorch_lightning``) or the Trainer-side packages.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_zero"

CORE = ("distributed", "offload", "diagnostics", "checkpoint")
TRAINER_SIDE = ("strategies", "callbacks", "cli")  # may import lightning.pytorch
# The package's own face sits above every folder: ``__init__.py`` re-exports both adapters (and registers their
# strategy names), ``__main__.py`` runs the CLI.
TOP = ("__init__.py", "__main__.py")
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")
TRAINER_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
# lightning_zero packages that import Lightning (so importing them imports it) / the Trainer.
ADAPTER_PACKAGES = ("lightning_zero.strategies", "lightning_zero.fabric", "lightning_zero.callbacks",
                    "lightning_zero.cli")
TRAINER_ADAPTER_PACKAGES = ("lightning_zero.strategies", "lightning_zero.callbacks", "lightning_zero.cli")

# Known violations, each with the reason it stays; empty today. An entry is (module path relative to lightning_zero/,
# imported module). Adding one needs a reason in a comment, so a break of the layout is visible, never hidden.
ALLOWED: set[tuple[str, str]] = set()


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_statements(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, list[str]]]:
    """``(line, modules)`` for every import statement in ``source`` (the text of ``module``), relative imports
    resolved; for ``from X import a`` the modules are ``X`` and ``X.a`` (``a`` may be a submodule)."""
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
            yield node.lineno, [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    return {name for _, names in import_statements(source, module, is_package) for name in names}


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def layout_violations(root: Path = PACKAGE) -> list[str]:
    """``"file: imports X (rule)"`` for every import under ``root`` (a ``lightning_zero`` tree) that breaks a rule."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.as_posix() in TOP:
            continue
        area = relative.parts[0] if len(relative.parts) > 1 else ""  # "": a top-level module (optim_factory.py...)
        module = _module_name(path, root)
        for line, names in sorted(import_statements(path.read_text(), module, path.name == "__init__.py")):
            for name in names:  # one report per statement: the first name that breaks a rule
                if (relative.as_posix(), name) in ALLOWED:
                    continue
                if area == "fabric" and _within(name, ("lightning_zero.strategies",)):
                    rule = "fabric/ never imports strategies/"
                elif area in CORE and _within(name, LIGHTNING_PACKAGES + ADAPTER_PACKAGES):
                    rule = f"{area}/ imports no Lightning"
                elif area not in TRAINER_SIDE and _within(name, TRAINER_PACKAGES + TRAINER_ADAPTER_PACKAGES):
                    rule = "only strategies/, callbacks/, cli/ import the Trainer"
                else:
                    continue
                found.append(f"{relative}:{line}: imports {name} ({rule})")
                break
    return found


def test_package_follows_the_layout():
    assert PACKAGE.is_dir() and any(PACKAGE.joinpath("fabric").glob("*.py"))
    assert layout_violations() == []


def test_allow_list_names_only_real_imports():
    # a stale allow-list entry would silently permit the import again later
    for relative, name in ALLOWED:
        path = PACKAGE / relative
        assert name in imported_modules(path.read_text(), _module_name(path, PACKAGE),
                                        path.name == "__init__.py"), (relative, name)


@pytest.mark.parametrize(("relative", "source", "rule"), [
    ("fabric/x.py", "from lightning_zero.strategies.trainer_precision import ZeroPrecision", "never imports strategies"),
    ("fabric/x.py", "def f():\n    from ..strategies import zero\n", "never imports strategies"),
    ("fabric/x.py", "from lightning_zero import strategies", "never imports strategies"),
    ("distributed/x.py", "import lightning.fabric", "imports no Lightning"),
    ("checkpoint/x.py", "def f():\n    from lightning_fabric.utilities import rank_zero\n", "imports no Lightning"),
    ("diagnostics/x.py", "from lightning_zero.fabric import settings", "imports no Lightning"),
    ("fabric/x.py", "def f():\n    from lightning.pytorch import LightningModule\n", "import the Trainer"),
    ("x.py", "import pytorch_lightning", "import the Trainer"),
    ("pipeline/x.py", "from ..callbacks import ThroughputLogger", "import the Trainer"),
])
def test_each_rule_catches_its_violation(tmp_path, relative, source, rule):
    root = tmp_path / "lightning_zero"
    path = root / relative
    path.parent.mkdir(parents=True)
    path.write_text(source)
    found = layout_violations(root)
    assert len(found) == 1 and rule in found[0], found


@pytest.mark.parametrize(("relative", "source"), [
    ("fabric/x.py", "from lightning.fabric.plugins.precision import Precision\nfrom . import settings"),
    ("strategies/x.py", "from lightning.pytorch import Trainer\nfrom lightning_zero.fabric import validation"),
    ("distributed/x.py", "import torch\nfrom lightning_zero.ops import loss_scaler"),
])
def test_allowed_directions_pass(tmp_path, relative, source):
    path = tmp_path / "lightning_zero" / relative
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert layout_violations(tmp_path / "lightning_zero") == []
