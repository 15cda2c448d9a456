"""Layers import downward only, and heavy libraries are imported lazily where used.

Three checks: (1) import every module of a layer in a fresh interpreter in which
the forbidden libraries raise ImportError; (2) parse every module's imports
and check no ``openpack.<layer>`` import points upward (DESIGN.md, Layers);
(3) no two modules import each other, directly or through others, lazy
imports inside functions included.
"""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import openpack
import openpack.core

# bottom -> top. rollout sits under trainers: the online loop (rl) drives engines and weight sync, and rollout never
# reaches back into a trainer, the loop, orchestration or the CLI. rl builds on what every trainer shares (the run
# loop, reference models, tracking), and no offline trainer knows the online loop. config (every command's sections,
# checks and run) sits on orchestration: its checks ask rl, rollout and models what a run can do, and a command runs
# through orchestration's launcher; orchestration reads a run config's sections without importing config.
LAYERS = ["core", "data", "models", "distributed", "rollout", "trainers", "rl", "orchestration", "config", "cli"]
FORBIDDEN_AT_IMPORT = {
    "core": ["transformers", "ray", "deepspeed", "vllm", "flash_attn", "datasets"],
    "data": ["ray", "deepspeed", "vllm", "flash_attn"],
    "models": ["ray", "deepspeed", "vllm", "flash_attn"],
    "rollout": ["ray", "deepspeed", "vllm", "flash_attn"],  # vLLM and Ray only inside the functions that use them
}
ROOT = Path(openpack.__file__).parent

BLOCKER = """
import importlib, importlib.abc, pkgutil, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"blocked for this test: {{name}}")
sys.meta_path.insert(0, Block())
import openpack.{layer} as layer
for info in pkgutil.walk_packages(layer.__path__, "openpack.{layer}."):
    importlib.import_module(info.name)
print("ok")
"""


def layer_modules(layer):
    return sorted((ROOT / layer).rglob("*.py")) if (ROOT / layer).is_dir() else []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN_AT_IMPORT))
def test_layer_imports_without_heavy_libraries(layer):
    if not layer_modules(layer):
        pytest.skip(f"openpack.{layer} has no modules yet")
    code = BLOCKER.format(blocked=set(FORBIDDEN_AT_IMPORT[layer]), layer=layer)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def imported_names(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_imports_point_down_only():
    upward = []
    for rank, layer in enumerate(LAYERS):
        for path in layer_modules(layer):
            for name in imported_names(path):
                parts = name.split(".")
                if parts[0] == "openpack" and len(parts) > 1 and parts[1] in LAYERS:
                    if LAYERS.index(parts[1]) > rank:
                        upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, upward


def test_core_uses_no_torch_distributed():
    offenders = [
        str(p.relative_to(ROOT)) for p in layer_modules("core")
        if any(n.startswith("torch.distributed") for n in imported_names(p))
    ]
    assert not offenders


def test_the_check_itself_sees_modules():
    """Guard against a vacuous pass: the core layer exists and is walked."""
    assert len(layer_modules("core")) >= 3
    assert any(True for _ in pkgutil.walk_packages(openpack.core.__path__))


def module_name(path, root=ROOT):
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root=ROOT):
    """``{module: {openpack modules it imports}}``, from every import statement (lazy ones too); ``from pkg import
    name`` counts as importing ``pkg.name`` where that is a module."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in paths else node.module
                           for alias in node.names]
            else:
                continue
            edges |= {t for t in targets if t in paths and t != name and not name.startswith(t + ".")}
        graph[name] = edges
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan), each sorted: every import cycle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert "openpack.rollout.engine_group" in graph["openpack.rl.generation"]  # lazy imports are seen
    assert not cycles(graph), cycles(graph)


def test_the_cycle_check_finds_a_cycle():
    """The finder itself can fail: a lazy import back into a module that imports it (the cycle rollout/ had
    between its engine group and weight sync) is reported, and a chain that only points down is not."""
    graph = {"rollout.engine_group": {"rollout.weight_sync"}, "rollout.weight_sync": {"rollout.engine_group"},
             "rl.step": {"rl.update"}, "rl.update": {"rl.experience"}, "rl.experience": set()}
    assert cycles(graph) == [["rollout.engine_group", "rollout.weight_sync"]]
    del graph["rollout.weight_sync"]
    assert cycles(graph) == []
