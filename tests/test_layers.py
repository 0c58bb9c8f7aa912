"""The package layout is the architecture: each part of `picker/` sits in a layer and imports only its own layer
and those below it (typing-only imports included), and the root holds the entry points only."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "picker"

# Bottom to top. A unit is a subpackage of picker/ (or a module at its root).
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"core", "__init__"}),  # the shared vocabulary (and the package's version)
    frozenset({"endpoints", "prefix", "kvevents"}),  # the pool, the pods' caches as the picker knows them
    frozenset({"scheduling", "flowcontrol"}),  # ranking pods; queueing requests
    frozenset({"routing"}),  # the director and its admission gates
    frozenset({"extproc", "api"}),  # the protocols in front of the director
    frozenset({"serving"}),  # `picker serve` assembled from config
    frozenset({"tools"}),  # the other commands of the serving package (explain, doctor)
    frozenset({"cli", "__main__"}),  # the command line
)
ROOT_MODULES_MAX = 6


def layer_of(unit: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"picker/{unit} is in no layer: add it to LAYERS")


def unit_of(module: str) -> str:
    """`picker.routing.director` -> routing; `picker.cli` -> cli; `picker` -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """Every picker module a file imports (at any depth, typing-only ones too), with its line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "picker":
                found += [(node.lineno, f"picker.{a.name}") for a in node.names]
            elif node.module.startswith("picker."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("picker.")]
    return found


def upward_imports() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        unit = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        level = layer_of(unit)
        for line, module in imported(ast.parse(path.read_text())):
            target = "__init__" if module == "picker.__version__" else unit_of(module)
            if layer_of(target) > level:
                out.append(f"picker/{rel}:{line} imports {module} (layer {layer_of(target)} above {level})")
    return out


def test_no_module_imports_a_layer_above_it() -> None:
    assert upward_imports() == []


def test_the_root_holds_the_entry_points_only() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_MODULES_MAX, root
    for path in PACKAGE.iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            layer_of(path.name)
            assert ast.get_docstring(ast.parse((path / "__init__.py").read_text())), f"{path.name} says what it owns"


def test_the_layer_check_sees_an_upward_import() -> None:
    tree = ast.parse("def f():\n    from picker.serving.config import ServeConfig\n")
    assert imported(tree) == [(2, "picker.serving.config")]
    assert layer_of(unit_of("picker.serving.config")) > layer_of("routing")



def test_the_product_never_imports_the_lab() -> None:
    """The lab (lab/picker_lab: simulator, benchmarks, demo, supervisor) imports the picker, never the reverse;
    the command line names the lab's commands by module only (picker.cli.SUBCOMMANDS)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [f"{path.relative_to(PACKAGE)}:{node.lineno}" for n in names if n.split(".")[0] == "picker_lab"]
    assert found == []
