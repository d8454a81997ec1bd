"""The package layers point one way, and the API process never loads torch.

    stack                                  the processes: launcher, CLI, Celery tasks, scaler
    api    batcher    gen_pool             the edge and the two workers: none imports another's
                                           package, but for the API's use of the generation
                                           pool's request contracts (SHARED_WITH_API)
    billing    tenancy                     accounts, keys, money (one layer: each reads the other)
    bases    checkpoints    scaleout       the domains: base models, checkpoints, scale-out policies
    core                                   plumbing: settings, stores, work items, queue, consumer
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"core": 0, "bases": 1, "checkpoints": 1, "scaleout": 1, "billing": 2, "tenancy": 2,
          "api": 3, "batcher": 3, "gen_pool": 3, "stack": 4}
DOMAINS = {"bases", "checkpoints", "scaleout"}
PROCESSES = {"api", "batcher", "gen_pool"}
# The generation pool's modules the API imports: the sample group's spec, where a group goes, the
# sampling outputs' request contract and where a stability record is kept.
SHARED_WITH_API = {"gen_pool.params", "gen_pool.router", "gen_pool.routing", "gen_pool.outputs", "gen_pool.stability"}


def _imports(path: Path) -> set[str]:
    """The first-party modules `path` imports, as dotted names."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {m for m in out if m.split(".")[0] in LAYERS}


def _arrows() -> list[tuple[str, str, str]]:
    """(file, its package, an imported module of another first-party package)."""
    out = []
    for pkg in LAYERS:
        for path in (ROOT / pkg).rglob("*.py"):
            for module in _imports(path):
                if module.split(".")[0] != pkg:
                    out.append((str(path.relative_to(ROOT)), pkg, module))
    return out


def test_no_import_runs_up_a_layer():
    up = [(f, m) for f, pkg, m in _arrows() if LAYERS[m.split(".")[0]] > LAYERS[pkg]]
    assert up == []


def test_core_and_the_domains_import_only_core():
    wide = [(f, m) for f, pkg, m in _arrows() if pkg in DOMAINS | {"core"} and m.split(".")[0] != "core"]
    assert wide == []


def test_no_process_imports_another_ones_package():
    crossing = [(f, m) for f, pkg, m in _arrows() if pkg in PROCESSES and m.split(".")[0] in PROCESSES
                and not (pkg == "api" and any(m == s or m.startswith(s + ".") for s in SHARED_WITH_API))]
    assert crossing == []


def test_importing_the_api_app_loads_no_torch():
    code = ("import sys, api.app; heavy = [m for m in ('torch', 'transformers', 'peft', 'vllm', 'batcher') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _module_of(name: str) -> str | None:
    """The first-party module a dotted import names (`batcher.engine.gang.Leader` -> its module)."""
    parts = name.split(".")
    while parts:
        path = ROOT.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return None


def _module_graph() -> dict[str, set[str]]:
    """Each first-party module's imports of other first-party modules, those made inside functions
    and under `if TYPE_CHECKING:` included (an import hidden in a function is still an arrow)."""
    graph: dict[str, set[str]] = {}
    for pkg in LAYERS:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            graph[name] = {m for imported in _imports(path) if (m := _module_of(imported)) and m != name}
    return graph


def _cycles_within_packages(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module among arrows that stay inside one
    top-level package (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w.split(".")[0] != v.split(".")[0]:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_a_package():
    assert _cycles_within_packages(_module_graph()) == []


def test_the_cycle_rule_sees_an_import_made_inside_a_function():
    graph = {"batcher.engine.a": {"batcher.engine.b"}, "batcher.engine.b": {"batcher.engine.a"},
             "batcher.engine.c": {"core.x"}, "core.x": {"batcher.engine.c"}}  # (across packages: layers' rule)
    assert _cycles_within_packages(graph) == [["batcher.engine.a", "batcher.engine.b"]]
    tree = ast.parse("def f():\n    from batcher.engine import gang\n")
    imported = {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {_module_of(m) for m in imported} == {"batcher.engine.gang"}


def test_the_engine_imports_nothing_of_the_loop():
    """batcher.engine is the trainer's lower floor: the loop (the rest of batcher/) calls it, never the
    other way round."""
    up = sorted((m, i) for m, imports in _module_graph().items() if m.startswith("batcher.engine")
                for i in imports if i.startswith("batcher.") and not i.startswith("batcher.engine"))
    assert up == []
