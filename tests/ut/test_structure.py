"""The house rules of vllm_ascend, checked on its source (DESIGN.md section 2, issue 66): no
import circle, arrows between areas pointing down only, no file over 500 lines and no class
over 300, every file included. An import inside a function counts as an arrow too: it runs
as surely as one at the top, only later."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_ascend"
MAX_FILE_LINES, MAX_CLASS_LINES = 500, 300

# The areas from the lowest to the highest: a module may import from its own area and from
# the areas below it. (The package's __init__, register(), is the entry point: the top.)
LAYERS = [
    {"logger"},
    {"device"},
    {"device_allocator"},
    {"attention"},
    {"compilation"},
    {"ops", "lora"},
    {"quantization", "models"},
    {"patch"},
    {"plan"},
    {"serving"},
    {"worker"},
    {"platform"},
    {"cli", ""},
]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The package's modules that ``name`` imports, at the top or inside a function. ``from a
    import b`` is an arrow to the module a.b when there is one, else to a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> int:
    area = _area(module)
    for level, areas in enumerate(LAYERS):
        if area in areas:
            return level
    raise AssertionError(f"{module}: its area {area!r} has no place in LAYERS; give it one")


def _circles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
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

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    circles = _circles()
    described = ["; ".join(f"{a} -> {b}" for a in c for b in sorted(GRAPH[a]) if b in c)
                 for c in circles]
    assert not circles, "import circles:\n" + "\n".join(described)


def test_arrows_between_areas_point_down():
    up = [f"{a} -> {b}" for a in sorted(GRAPH) for b in sorted(GRAPH[a])
          if _layer(b) > _layer(a)]
    assert not up, "imports of a higher area (move what both need to the lower one):\n" + \
        "\n".join(up)


def test_no_file_over_500_lines_and_no_class_over_300():
    too_long = []
    for name, path in MODULES.items():
        text = path.read_text()
        lines = text.count("\n") + (not text.endswith("\n") and bool(text))
        if lines > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}: class {node.name}, {size} lines")
    assert not too_long, "\n".join(too_long)


@pytest.mark.parametrize("source,expected", [
    ("from vllm_ascend.device.sim import npu", {"vllm_ascend.device.sim.npu"}),
    ("from vllm_ascend.device import torch_npu", {"vllm_ascend.device"}),
    ("def f():\n    from vllm_ascend.worker import choice", {"vllm_ascend.worker.choice"}),
    ("from . import memory", {"vllm_ascend.device.sim.memory"}),
    ("import vllm_ascend.plan", {"vllm_ascend.plan"}),
])
def test_the_walk_sees_every_kind_of_import(source, expected, tmp_path):
    """The rules above are only as good as the walk: each form of import is an arrow."""
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert _imports("vllm_ascend.device.sim.probe", path) == expected
