"""No module of the package imports one that imports it back, function-level imports included (read from the
sources, not from what happens to be imported at run time). Imports under `if TYPE_CHECKING:` are left out: they
never run, and they are how the runtime's fields are typed by the modules that fill them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in [*ROOT.glob("sgl_entropic/**/*.py"), *ROOT.glob("kernels/*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "kernels":  # installed as sgl_entropic.kernels
            parts = ["sgl_entropic", *parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
            for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                # `from pkg import submodule` depends on the submodule (the package's __init__ runs for any)
                names = subs if all(s in mods for s in subs) else [base, *subs]
            else:
                continue
            graph[mod].update(n for n in names if n in mods and n != mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert "sgl_entropic.plugin.runtime" in graph["sgl_entropic.plugin.hooks"]  # the graph reads real imports
    assert cycles(graph) == []


def test_the_cores_never_import_sglang_or_the_plugin():
    cores = ("costs", "signal", "sampling", "scheduling", "pruning", "speculative", "transfer", "crossover")
    for mod, path in _modules().items():
        parts = mod.split(".")
        if len(parts) < 2 or parts[1] not in cores:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert not name.startswith(("sglang", "sgl_entropic.plugin")), (mod, name)
