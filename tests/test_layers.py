"""The package's layers: every import points down or sideways, never back up.

``LAYERS`` lists convcheck's packages and top-level modules from the ground up; a module may import
from its own layer or any layer below it, never from a layer above (function-level imports
included: a lazy import that runs back up is still a dependency that runs back up). The same table
is drawn in docs/ARCHITECTURE.md ("Layers"). A new package or top-level module must be placed in it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# From the ground up. A name is a package (every module under it) or a top-level module.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "exit_codes", "run_stage", "files", "seeding", "nested", "batch", "capture", "discovery", "numerics",
     "steps"),
    ("env",),
    ("runformat",),
    ("targets",),
    ("plan",),
    ("measure",),
    ("watch",),
    ("diagnose", "verify"),
    ("ddp",),
    ("report",),
    ("stages",),
    ("pipeline",),
    ("bundle", "analysis"),
    ("assertions", "integrations"),
    ("cli", "pytest_plugin", "__main__"),
]


def module_names(root: Path, package: str = "convcheck") -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of ``package`` under ``root``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(path: Path, name: str, known: dict[str, Path], package: str = "convcheck") -> set[str]:
    """The modules of ``package`` that the file imports, anywhere in it (functions included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            found.update(b for b in bases if b == package or b.startswith(package + "."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base == package or base.startswith(package + "."):
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in known else base)
    return found


def layer_of(module: str, layers=LAYERS, package: str = "convcheck") -> int | None:
    """The index of the layer that holds ``module`` (None: the package's face, or not placed)."""
    rest = module[len(package) + 1:] if module.startswith(package + ".") else ""
    top = rest.split(".")[0]
    for i, names in enumerate(layers):
        if top in names:
            return i
    return None


def imports_back_up(root: Path, layers=LAYERS, package: str = "convcheck") -> list[str]:
    """``"a -> b"`` for every import from a lower layer into a higher one; modules no layer holds are
    reported too (every module must be placed)."""
    known = module_names(root, package)
    problems = []
    for name, path in known.items():
        if name == package:
            continue
        mine = layer_of(name, layers, package)
        if mine is None:
            problems.append(f"{name} is in no layer (place it in LAYERS)")
            continue
        for target in sorted(imports_of(path, name, known, package)):
            if target == package:
                continue
            theirs = layer_of(target, layers, package)
            if theirs is not None and theirs > mine:
                problems.append(f"{name} (layer {mine}) -> {target} (layer {theirs})")
    return problems


def test_no_import_runs_back_up():
    assert imports_back_up(ROOT) == []


def test_the_check_catches_an_import_back_up(tmp_path):
    pkg = tmp_path / "convcheck"
    (pkg / "env").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "env" / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "env" / "audit.py").write_text("def f():\n    from convcheck.cli import main\n")
    (pkg / "cli.py").write_text("from convcheck.env import audit\nfrom . import errors\n")
    assert imports_back_up(tmp_path) == ["convcheck.env.audit (layer 1) -> convcheck.cli (layer 14)"]


def test_every_layer_name_exists():
    known = module_names(ROOT)
    tops = {name.split(".")[1] for name in known if name.count(".") >= 1}
    missing = [n for names in LAYERS for n in names if n not in tops]
    assert missing == []


@pytest.mark.parametrize("text", ["import convcheck.cli", "from convcheck import cli"])
def test_every_import_form_is_read(tmp_path, text):
    pkg = tmp_path / "convcheck"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text(text + "\n")
    (pkg / "cli.py").write_text("")
    assert imports_back_up(tmp_path) == ["convcheck.errors (layer 0) -> convcheck.cli (layer 14)"]
