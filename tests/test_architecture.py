"""The shape of the package: no import circle, no private name crossing modules, short modules.

An AST walk of `keras_ipu/` (imports inside functions count), so the house
stays the way docs/architecture.md describes it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_ipu"
MAX_MODULE_LINES = 700
# Data tables, not code: the IPUConfig attribute schema.
LONG_DATA_MODULES = {"keras_ipu.config.attributes"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _imports(module: str, source: str | None = None) -> list[tuple[str, str]]:
    """`(imported module, name or "")` for every keras_ipu import, functions included.

    `source` stands in for the module's file (to test the walker itself).
    """
    tree = ast.parse(MODULES[module].read_text() if source is None else source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names
                      if alias.name.startswith("keras_ipu")]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if not source.startswith("keras_ipu"):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((submodule, "") if submodule in MODULES else (source, alias.name))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_import_circle_in_the_keras_integration():
    graph = {
        module: {target for target, _ in _imports(module)
                 if target.startswith("keras_ipu.keras") and target != module}
        for module in MODULES if module.startswith("keras_ipu.keras")
    }
    assert _cycles(graph) == []


def test_the_device_layer_and_the_config_never_import_the_keras_integration():
    for module in MODULES:
        if module.startswith(("keras_ipu.device", "keras_ipu.config")):
            upward = [t for t, _ in _imports(module) if t.startswith("keras_ipu.keras")]
            assert upward == [], f"{module} imports {upward}"


def test_no_private_name_is_imported_from_another_module():
    crossing = [
        f"{module} imports {name} from {source}"
        for module in MODULES
        for source, name in _imports(module)
        if name.startswith("_") and not name.startswith("__")
    ]
    assert crossing == []


def test_modules_stay_short():
    long = {
        module: len(path.read_text().splitlines())
        for module, path in MODULES.items()
        if module not in LONG_DATA_MODULES
    }
    assert {m: n for m, n in long.items() if n > MAX_MODULE_LINES} == {}


def test_the_checks_see_circles_and_private_names():
    # The walker itself: a two-module circle and a private import are found.
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    source = ("def f():\n    from keras_ipu.keras import _hidden, run\n"
              "    from .stages import graph\n")
    assert _imports("keras_ipu.keras.trainer", source) == [
        ("keras_ipu.keras", "_hidden"), ("keras_ipu.keras.run", ""),
        ("keras_ipu.keras.stages.graph", ""),
    ]


@pytest.mark.parametrize("module", ["keras_ipu.keras.strategy", "keras_ipu.keras.context"])
def test_modules_the_issue_names_exist(module):
    assert module in MODULES


def test_the_serving_runtime_imports_neither_keras_nor_the_keras_integration():
    # A serving process loads exports with the runtime alone (tested in a fresh
    # process by test_examples too).
    for module in ("keras_ipu.serving", "keras_ipu.serving.runtime"):
        tree = ast.parse(MODULES[module].read_text())
        top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        names = [alias.name for node in top_level if isinstance(node, ast.Import)
                 for alias in node.names]
        names += [node.module or "" for node in top_level if isinstance(node, ast.ImportFrom)]
        assert [n for n in names if n.split(".")[0] == "keras" or
                n.startswith("keras_ipu.keras")] == [], module
