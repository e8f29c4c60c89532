"""The package's import graph: no circles, and imports point downward through the layers of the design
(cli/server/bench -> engine -> graphs -> model -> runtime -> cache/io/store), with the simulator's side
torch-free."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moestream"
# lower number = lower layer; a module may import its own layer or lower ones
LAYERS = {
    **dict.fromkeys(("units", "errors", "hfconfig"), 0),
    **dict.fromkeys(("store", "io", "ggml", "kernels", "power"), 1),
    "cache": 2,
    **dict.fromkeys(("trace", "runtime"), 3),
    **dict.fromkeys(("model", "synth"), 4),
    "graphs": 5,
    "engine": 6,
    **dict.fromkeys(("bench", "server"), 7),
    "cli": 8,
    **dict.fromkeys(("__main__", ""), 9),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("moestream", *path.relative_to(PACKAGE).with_suffix("").parts))
        mods[name.removesuffix(".__init__")] = path
    return mods


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moestream"):
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [node.module, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("moestream")]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else ""]


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_imports_point_downward():
    upward = [
        (m, t)
        for m, targets in _graph().items()
        for t in targets
        if t != "moestream" and _layer(t) > _layer(m)
    ]
    assert upward == []


def test_the_simulator_side_imports_no_torch():
    graph, mods = _graph(), _modules()
    torch_free = [
        m
        for m in graph
        if m.startswith(("moestream.trace.", "moestream.cache.policy"))
        and not m.startswith("moestream.trace.writer")
    ]
    for module in torch_free:
        source = mods[module].read_text()
        assert "import torch" not in source, module
