"""The package layers point one way: the shared package (core) imports no feature package, and the
API process never loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FEATURES = {"api", "batcher", "gen_pool", "billing", "tenancy", "stack"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_the_shared_package_imports_no_feature_package():
    offenders = {p.name: sorted(_imports(p) & FEATURES) for p in (ROOT / "core").glob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_nothing_but_the_top_package_imports_it():
    users = [str(p.relative_to(ROOT)) for pkg in FEATURES - {"stack"} | {"core"}
             for p in (ROOT / pkg).rglob("*.py") if "stack" in _imports(p)]
    assert users == []


def test_importing_the_api_app_loads_no_torch():
    code = ("import sys, api.app; heavy = [m for m in ('torch', 'transformers', 'peft', 'vllm', 'batcher') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
