"""Every benchmark runs as `python bench/<name>.py` from a checkout with no PYTHONPATH, and imports
that checkout's packages (bench/_root.py), not an installed copy: the venv's editable install may
point at another tree, so each check below looks at where the modules came from.

Three checks, none of which runs a benchmark's work: each bench imports `_root` before anything
else (static); in a process set up as `python bench/<name>.py` sets one up, every top-level module
any bench imports resolves to this checkout when it is one of the project's; and the benches whose
--help imports neither torch nor tinker (seconds each) answer `--help`, run exactly so, with every
project module they load read from this checkout."""

from __future__ import annotations

import ast
import json
import os
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
HELPERS = {"_root", "flags", "table", "framework_floor", "_quota_lock_arms"}  # imported by benches or served by uvicorn, not run
BENCHES = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in HELPERS)
HEAVY = {"torch", "tinker"}  # importing either takes seconds: those benches' --help runs are left out


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _tree(name: str) -> ast.Module:
    return ast.parse((BENCH / f"{name}.py").read_text())


def _imported(tree: ast.Module) -> set[str]:
    """Top-level names of every absolute import in the file, wherever it is (lazy ones too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - {"__future__"}


def _project_names() -> set[str]:
    """Top-level names this checkout provides: its packages, the SDK's, bench and its modules."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    return packages | {"quilt", "bench"} | {p.stem for p in BENCH.glob("*.py")}


def test_the_benches_are_found():
    assert len(BENCHES) >= 20 and "fused_step" in BENCHES and "api_load" in BENCHES


@pytest.mark.parametrize("name", BENCHES)
def test_each_bench_imports_root_before_anything_else(name):
    imports = [node for node in _tree(name).body if isinstance(node, (ast.Import, ast.ImportFrom))
               and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
    first = imports[0]
    assert isinstance(first, ast.Import) and [a.name for a in first.names] == ["_root"], \
        f"bench/{name}.py must `import _root` before its other imports (line {first.lineno})"


def test_every_project_import_of_the_benches_resolves_to_this_checkout(tmp_path):
    wanted = sorted(set().union(*(_imported(_tree(name)) for name in BENCHES)) & _project_names())
    # What `python bench/<name>.py` does to sys.path: the script's folder first, the working
    # directory not at all; then the bench's first line. find_spec of a top-level name runs nothing.
    probe = ("import importlib.util, json, sys\n"
             f"sys.path[0] = {str(BENCH)!r}\n"
             "import _root\n"
             f"specs = {{n: importlib.util.find_spec(n) for n in {wanted!r}}}\n"
             "print(json.dumps({n: [s.origin, list(s.submodule_search_locations or [])] if s else None\n"
             "                  for n, s in specs.items()}))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert {"core", "batcher", "api", "bench", "quilt"} <= set(found)
    for name, spec in found.items():
        assert spec is not None, f"{name} is not importable"
        origin, locations = spec
        places = [Path(p) for p in ([origin] if origin else []) + locations]
        assert places and all(p.resolve().is_relative_to(ROOT) for p in places), f"{name} comes from {places}"


def _light(name: str) -> bool:
    top = {node for node in _tree(name).body if isinstance(node, (ast.Import, ast.ImportFrom))}
    return not (_imported(ast.Module(body=list(top), type_ignores=[])) & HEAVY)


def _outside_python(path: Path) -> bool:
    """Not the interpreter's own files (standard library, site-packages): the project's, somewhere."""
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                             *site.getsitepackages())}
    return not any(path.is_relative_to(prefix) for prefix in prefixes)


@pytest.mark.parametrize("name", [name for name in BENCHES if _light(name)])
def test_a_bench_answers_help_with_this_checkouts_modules(name, tmp_path):
    # -v reports the file every module's code came from ("# code object from <path>").
    done = subprocess.run([sys.executable, "-v", str(BENCH / f"{name}.py"), "--help"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout
    loaded = [Path(m.group(1)).resolve()
              for m in re.finditer(r"^# code object from '?(/[^'\n]+)'?$", done.stderr, re.M)]
    assert (BENCH / "_root.py").resolve() in loaded
    elsewhere = [p for p in loaded if _outside_python(p) and not p.is_relative_to(ROOT)]
    assert elsewhere == [], f"bench/{name}.py loaded project code from another tree: {elsewhere[:5]}"
