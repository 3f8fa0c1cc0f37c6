"""The seams hold: typed handles match their actors, imports point down with no cycle, and nothing
outside the group implementations drives an actor by a method-name string."""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from runtime.placement.handles import EngineHandle, TrainerHandle
from runtime.rollout.base import RolloutEngine

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["cli", "deployments", "flows", "tasks", "runtime"]  # each may import only those after it
GROUP_IMPLEMENTATIONS = {"runtime/placement/groups.py", "runtime/placement/subprocess_group.py",
                         "runtime/placement/handles.py"}


def _params(fn) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)
    # Ray's tracing adds `_ray_trace_ctx` to the methods of a class it has made an actor of
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()
            if p.name != "self" and not p.name.startswith("_ray")]


def _forwarded(handle_cls) -> list[str]:
    return [n for n, f in vars(handle_cls).items() if getattr(f, "forwards_to_actor", False)]


def test_trainer_handle_matches_the_trainer_methods():
    from runtime.trainer.megatron_trainer import MegatronTrainer
    names = _forwarded(TrainerHandle)
    assert {"train", "save", "load", "hf_weights", "broadcast_weights"} <= set(names)
    for name in names:
        assert _params(getattr(TrainerHandle, name)) == _params(getattr(MegatronTrainer, name)), name


def test_engine_handle_covers_the_engine_interface():
    interface = {n for n, f in vars(RolloutEngine).items() if callable(f) and not n.startswith("_")} - {"shutdown"}
    assert set(_forwarded(EngineHandle)) == interface
    for name in interface:
        assert _params(getattr(EngineHandle, name)) == _params(getattr(RolloutEngine, name)), name


@pytest.mark.parametrize("engine", ["runtime.rollout.builtin:BuiltinEngine", "runtime.rollout.sglang:SGLangEngine"])
def test_engines_implement_the_interface_with_its_parameters(engine):
    import importlib
    module, _, name = engine.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert not inspect.isabstract(cls)
    for method, fn in vars(RolloutEngine).items():
        if callable(fn) and not method.startswith("_"):
            want = _params(fn)
            got = _params(getattr(cls, method))[:len(want)]  # extra trailing parameters with defaults are fine
            assert [(n, k) for n, k, _ in got] == [(n, k) for n, k, _ in want], (engine, method)


def _modules() -> dict[str, Path]:
    mods = {}
    for top in LAYERS:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imports(mod: str, path: Path, known: set[str]) -> set[str]:
    """Every module of ours `mod` imports, function-local imports included."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != mod:
                out.add(name)
    return out


def test_imports_point_down_and_form_no_cycle():
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    rank = lambda m: LAYERS.index(m.split(".")[0])  # noqa: E731
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if rank(d) < rank(m))
    assert upward == []
    # Tarjan's strongly connected components: a component of more than one module is a cycle
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    # a package importing its own submodules is not a cycle of design
    cycles = [c for c in cycles if not all(x.startswith(c[0] + ".") or x == c[0] for x in c)]
    assert cycles == []


def test_no_actor_is_driven_by_a_method_name_outside_the_groups():
    offenders = []
    for top in ("runtime", "tasks", "flows", "cli"):
        for path in (ROOT / top).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if rel in GROUP_IMPLEMENTATIONS:
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\.(call|submit|invoke)\(\s*[\"']", line):
                    offenders.append(f"{rel}:{i}: {line.strip()}")
    assert offenders == []
