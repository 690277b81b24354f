"""Every ```python and ```bash block of README.md and docs/*.md, checked as a reader would copy it.

Python blocks run in a fresh namespace, in a temporary working directory, with the names a page declares in a
``<!-- snippet-fixture: name, name -->`` comment right before the fence filled from :data:`FIXTURES`. A block that
needs several nodes, a GPU, a checkpoint on disk or a long run is marked ``<!-- snippet: syntax-only -->``: it is
compiled, and every name it imports from ``lightning_zero`` must exist.

Bash blocks are checked with ``bash -n``; each ``lightning-zero SUB ...`` command is parsed by the CLI's own argparse
parser (without running it), and each ``python SCRIPT ...`` of this repository must name a script that exists and,
where the script uses argparse, only ``--options`` its source defines; the cheap subcommands (``estimate``) run as
written. Every relative link between the pages, and the heading it points at, must exist.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
FENCE = re.compile(r"^```(python|bash)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*snippet(-fixture)?:\s*(.*?)\s*-->")
#: the totals this suite saw when it was written: a block added or dropped changes them, so none goes unseen
EXPECTED = {"python": 25, "bash": 67}
#: subcommands cheap enough to run as written (no model, no process group)
CHEAP_SUBCOMMANDS = {"estimate"}


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    lang: str
    code: str
    syntax_only: bool
    fixtures: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _markers(text: str, start: int) -> tuple[bool, tuple[str, ...]]:
    """The ``snippet`` comments on the lines right above a fence (blank lines between them allowed)."""
    syntax_only, fixtures = False, ()
    for line in reversed(text[:start].rstrip("\n").splitlines()[-3:]):
        match = MARKER.search(line)
        if match is None:
            if line.strip():
                break
            continue
        if match.group(1):
            fixtures = tuple(name.strip() for name in match.group(2).split(",") if name.strip())
        elif match.group(2) == "syntax-only":
            syntax_only = True
        else:
            raise AssertionError(f"unknown snippet marker {line.strip()!r}")
    return syntax_only, fixtures


def collect() -> list[Snippet]:
    snippets = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            syntax_only, fixtures = _markers(text, match.start())
            line = text.count("\n", 0, match.start()) + 1
            name = str(page.relative_to(ROOT))
            snippets.append(Snippet(name, line, match.group(1), match.group(2), syntax_only, fixtures))
    return snippets


SNIPPETS = collect()
PYTHON = [s for s in SNIPPETS if s.lang == "python"]
BASH = [s for s in SNIPPETS if s.lang == "bash"]


# ---------------------------------------------------------------------------------------------------------- fixtures


def _tiny_model():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    model(torch.randn(2, 4)).sum().backward()
    return model


def _loss():
    import torch

    return _tiny_model()(torch.randn(2, 4)).sum()


def _block():
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x):
            return x + self.linear(x)

    return Block


class _Work:
    def wait(self):
        return True


#: what a page may ask for with ``<!-- snippet-fixture: ... -->``: each a factory, called per block
FIXTURES = {
    "Trainer": lambda: importlib.import_module("lightning.pytorch").Trainer,
    "torch": lambda: importlib.import_module("torch"),
    "model": _tiny_model,
    "loss": _loss,
    "MyBlock": _block,
    "Block": _block,
    "vocab": lambda: 32,
    "width": lambda: 8,
    "work": _Work,
    "seconds": lambda: 0.25,
}


# ------------------------------------------------------------------------------------------------------------ python


def _lightning_zero_imports(tree: ast.AST) -> list[tuple[str, str | None]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning_zero":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "lightning_zero"]
    return found


@pytest.mark.parametrize("snippet", PYTHON, ids=[s.id for s in PYTHON])
def test_python_snippet(snippet: Snippet, tmp_path, monkeypatch):
    code = compile(snippet.code, snippet.id, "exec")  # a SyntaxError names the page and line
    for module, name in _lightning_zero_imports(ast.parse(snippet.code)):
        imported = importlib.import_module(module)
        assert name is None or hasattr(imported, name), f"{snippet.id}: {module} has no {name}"
    if snippet.syntax_only:
        return
    unknown = set(snippet.fixtures) - set(FIXTURES)
    assert not unknown, f"{snippet.id}: no fixture named {sorted(unknown)}"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__snippet__"}
    namespace.update({name: FIXTURES[name]() for name in snippet.fixtures})
    exec(code, namespace)


# -------------------------------------------------------------------------------------------------------------- bash


def _commands(code: str) -> list[list[str]]:
    """Each command line of a block (continuations joined, comments dropped), split as bash would."""
    joined = re.sub(r"\\\n", " ", code)
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words = words[1:]  # VAR=value prefixes
        if words:
            commands.append(words)
    return commands


def _check_cli(words: list[str], where: str) -> None:
    from lightning_zero.cli import build_parser, main

    parser = build_parser()
    sub = words[1] if len(words) > 1 else None
    assert sub in parser._subparsers._group_actions[0].choices, f"{where}: no subcommand {sub!r}"
    if "--help" in words or "-h" in words:
        return
    try:
        parser.parse_args(words[1:])
    except SystemExit as exit_:
        raise AssertionError(f"{where}: the CLI refuses {' '.join(words)!r}") from exit_
    if sub in CHEAP_SUBCOMMANDS:
        assert main(words[1:]) == 0, f"{where}: {' '.join(words)!r} failed"


def _check_script(words: list[str], where: str) -> None:
    script = next((w for w in words[1:] if not w.startswith("-")), None)
    if words[1:2] == ["-m"] or script is None or not script.endswith(".py"):
        return
    path = ROOT / script
    if path.parts[len(ROOT.parts)] not in {"examples", "benchmarks"}:
        return  # a reader's own train.py
    assert path.is_file(), f"{where}: {script} does not exist"
    source = path.read_text()
    if "argparse" not in source:
        return
    sources = source + "".join(p.read_text() for p in path.parent.glob("_*.py"))
    for word in words[words.index(script) + 1 :]:
        option = word.split("=")[0]
        if option.startswith("--"):
            assert f'"{option}"' in sources or f"'{option}'" in sources, f"{where}: {script} has no {option}"


@pytest.mark.parametrize("snippet", BASH, ids=[s.id for s in BASH])
def test_bash_snippet(snippet: Snippet):
    result = subprocess.run(["bash", "-n"], input=snippet.code, capture_output=True, text=True)
    assert result.returncode == 0, f"{snippet.id}: {result.stderr}"
    if snippet.syntax_only:
        return
    for words in _commands(snippet.code):
        if words[0] == "lightning-zero":
            _check_cli(words, snippet.id)
        elif words[0] in {"python", "python3"}:
            _check_script(words, snippet.id)


def test_every_block_is_seen():
    counts = {lang: sum(s.lang == lang for s in SNIPPETS) for lang in EXPECTED}
    executed = sum(not s.syntax_only for s in PYTHON)
    print(f"doc snippets: {counts} ({executed} python executed, {len(PYTHON) - executed} python syntax-only)")
    assert counts == EXPECTED, f"the docs hold {counts} blocks; update EXPECTED after checking the new ones run"
    # a fence spelt otherwise (```py, ```sh, ```shell) would escape every check above
    for page in PAGES:
        for lang in re.findall(r"^```(py|sh|shell|console|python3)\s*$", page.read_text(), re.M):
            raise AssertionError(f"{page.name}: a ```{lang} block; spell it ```python or ```bash")


def test_reliability_hang_timeout_snippet_runs():
    block = next(s for s in PYTHON if s.page == "docs/reliability.md" and "hang_timeout=timedelta" in s.code)
    namespace: dict = {}
    exec(compile(block.code, block.id, "exec"), namespace)
    assert namespace["timedelta"](minutes=20).total_seconds() == 1200


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    """Every link from one page to another (and to a heading of it) lands: pages were moved and renamed."""
    broken = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", FENCE.sub("", file.read_text()), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
