"""Imports point one way, down the layers of docs/design.md; a test fails when one runs back up."""

from __future__ import annotations

import ast
from pathlib import Path

import specdec

PACKAGE = Path(specdec.__file__).parent

# Each part of specdec, bottom to top; a part may import its own layer and the layers below it.
LAYERS = [
    {"errors"},
    {"core"},
    {"drafters", "policies", "verifiers", "observers"},
    {"plugins"},
    {"config"},
    {"decoding"},
    {"training", "whisper", "bench", "audio", "convert", "prompts", "exactness"},
    {"cli"},
]
LEVEL = {part: level for level, parts in enumerate(LAYERS) for part in parts}
# Strategies sit side by side: none of them may import another kind of strategy.
STRATEGIES = {"drafters", "policies", "verifiers", "observers"}


def part_of(module: str) -> str | None:
    """``specdec.core.cache`` -> ``core``; a name of the package's front door (``specdec.__version__``,
    ``specdec.bundled_pair_path``), which re-exports from every layer, counts as the top."""
    parts = module.split(".")
    if parts[0] != "specdec" or len(parts) < 2:
        return None
    if parts[1] not in LEVEL and not (PACKAGE / parts[1]).exists() and not (PACKAGE / f"{parts[1]}.py").exists():
        return "cli"
    return parts[1]


def imports(path: Path) -> list[str]:
    """Every specdec module ``path`` imports, at module level or lazily inside a function."""
    module = "specdec." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append(target)
            if not node.module:  # "from . import hookspecs": the names are modules
                found += [f"{target}.{alias.name}" for alias in node.names]
    return [name for name in found if name.startswith("specdec.")]


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == PACKAGE and path.name == "__init__.py":
            continue  # the package's front door re-exports the public API from every layer
        relative = path.relative_to(PACKAGE)
        own = relative.parts[0].removesuffix(".py")
        assert own in LEVEL, f"{relative}: add specdec/{own} to a layer in tests/test_layers.py and docs/design.md"
        for target in imports(path):
            other = part_of(target)
            if other is None or other == own:
                continue
            if LEVEL.get(other, 99) > LEVEL[own]:
                found.append(f"{relative} imports {target} ({other} is above {own})")
            elif own in STRATEGIES and other in STRATEGIES:
                found.append(f"{relative} imports {target} (strategies do not import each other)")
    return found


class TestLayers:
    def test_no_import_runs_back_up(self):
        """Every import of every module of specdec, lazy ones included, points down the layers."""
        assert violations() == []

    def test_the_checker_sees_an_upward_import(self, tmp_path, monkeypatch):
        """The checker itself is not blind: a core module importing the loop is reported."""
        fake = tmp_path / "specdec"
        (fake / "core").mkdir(parents=True)
        (fake / "decoding").mkdir()
        (fake / "core" / "bad.py").write_text("def f():\n    from ..decoding.loop import SpeculativeDecoder\n")
        (fake / "decoding" / "loop.py").write_text("from ..core import bad\n")
        monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", fake)
        assert violations() == ["core/bad.py imports specdec.decoding.loop (decoding is above core)"]
