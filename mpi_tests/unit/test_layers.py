"""The package's layers: no module imports one above it or in a circle; layer kinds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from test_layers import ROOT


PACKAGE = ROOT / "hvd_lowcomm"


LAYERS = [
    ("registry", ["hvd_lowcomm.registry"]),
    (
        "foundation",
        [
            "hvd_lowcomm.options",
            "hvd_lowcomm.optimizers",
            "hvd_lowcomm.config",
            "hvd_lowcomm.metrics",
            "hvd_lowcomm.schedule",
            "hvd_lowcomm.task",
            "hvd_lowcomm.heldout",
            "hvd_lowcomm.time_to_quality",
            "hvd_lowcomm.trackers",
        ],
    ),
    (
        "comm",
        [
            "hvd_lowcomm.comm",
            "hvd_lowcomm.comm.engines",
            "hvd_lowcomm.comm.runtime",
            "hvd_lowcomm.comm.groups",
            "hvd_lowcomm.comm.devices",
            "hvd_lowcomm.comm.failures",
            "hvd_lowcomm.comm.traffic",
            "hvd_lowcomm.comm.rendezvous",
            "hvd_lowcomm.comm.half_wire",
            "hvd_lowcomm.comm.wire_codecs",
            "hvd_lowcomm.comm.mesh",
        ],
    ),
    ("elastic", ["hvd_lowcomm.elastic", "hvd_lowcomm.elastic.*"]),
    ("data and models", ["hvd_lowcomm.data", "hvd_lowcomm.models", "hvd_lowcomm.models.*"]),
    ("cost model", ["hvd_lowcomm.costmodel", "hvd_lowcomm.costmodel.*"]),
    ("methods", ["hvd_lowcomm.methods", "hvd_lowcomm.methods.*"]),
    (
        "harness",
        [
            "hvd_lowcomm.budget",
            "hvd_lowcomm.checkpoint",
            "hvd_lowcomm.loop",
            "hvd_lowcomm.auto",
            "hvd_lowcomm.train",
            "hvd_lowcomm.plan",
            "hvd_lowcomm.jobs",
        ],
    ),
    ("package", ["hvd_lowcomm"]),  # resolves its public names lazily, by string
]


LAZY = {
    "mpi4py",
    "horovod.torch",
    "h5py",
    "matplotlib",
    "matplotlib.pyplot",
    "torchvision",
    "transformers",
    "torch.utils.tensorboard",
    "wandb",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".*") and module.startswith(member[:-1])):
                return index
    raise AssertionError(f"{module} is in no layer of LAYERS: place it there")


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path) -> tuple[set[str], list[tuple[int, str]]]:
    """The package's modules `path` imports, and the imports it makes inside functions."""
    tree = ast.parse(path.read_text())
    own, inside = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from hvd_lowcomm.comm import runtime` imports the module hvd_lowcomm.comm.runtime
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names
            ]
        else:
            continue
        own.update(n for n in names if n in MODULES)
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    inside += [(node.lineno, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    inside.append((node.lineno, node.module or "."))
    return own, inside


GRAPH = {name: imports(path)[0] - {name} for name, path in MODULES.items()}


def upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs where the imported module sits in a higher layer."""
    return {
        (module, other) for module, others in graph.items() for other in others if layer_of(other) > layer_of(module)
    }


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in order, the first repeated), or None."""
    done: set[str] = set()
    active: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in active:
            return active[active.index(module) :] + [module]
        if module in done:
            return None
        active.append(module)
        for other in sorted(graph.get(module, ())):
            found = visit(other)
            if found:
                return found
        active.pop()
        done.add(module)
        return None

    return next((found for module in sorted(graph) if (found := visit(module))), None)


def test_no_module_imports_one_above_it():
    assert not upward(GRAPH), "imports from a higher layer: " + ", ".join(
        f"{a} -> {b}" for a, b in sorted(upward(GRAPH))
    )


def test_no_modules_import_each_other_in_a_circle():
    assert circle(GRAPH) is None, f"import circle: {' -> '.join(circle(GRAPH))}"


def test_a_package_belongs_to_its_own_layer():
    """`from hvd_lowcomm.methods import x` below the methods layer runs methods/__init__.py: an
    upward import like any other."""
    assert layer_of("hvd_lowcomm.methods") == layer_of("hvd_lowcomm.methods.diloco")
    assert layer_of("hvd_lowcomm.comm") == layer_of("hvd_lowcomm.comm.runtime")
    assert layer_of("hvd_lowcomm.models") == layer_of("hvd_lowcomm.models.transformer")
    assert ("hvd_lowcomm.config", "hvd_lowcomm.methods") in upward({"hvd_lowcomm.config": {"hvd_lowcomm.methods"}})


def test_the_checks_catch_an_upward_import_and_a_circle():
    assert upward({"hvd_lowcomm.config": {"hvd_lowcomm.loop"}, "hvd_lowcomm.loop": {"hvd_lowcomm.config"}}) == {
        ("hvd_lowcomm.config", "hvd_lowcomm.loop")
    }
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_are_at_the_top_except_lazy_dependencies(module):
    _, inside = imports(MODULES[module])
    misplaced = [(line, name) for line, name in inside if name not in LAZY]
    assert not misplaced, f"{module} imports inside functions: {misplaced}; import at the top of the module"
