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
# The generation pool's modules the API imports: the sample group's spec and where a group goes.
SHARED_WITH_API = {"gen_pool.params", "gen_pool.router", "gen_pool.routing"}


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
