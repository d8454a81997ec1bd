"""The documentation site: it builds with no warning (a broken link or anchor fails), and its
configuration reference names every QUILT_* variable the code reads, each with its meaning."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import docs_pages  # noqa: E402

# Where the project's own code and deployment read variables (tests and benchmarks set their own).
READERS = ["api", "bases", "batcher", "billing", "checkpoints", "core", "gen_pool", "scaleout", "stack", "tenancy",
           "sdk/quilt", "scripts", "deploy"]
VARIABLE = re.compile(r"\bQUILT_[A-Z0-9]+(?:_[A-Z0-9]+)*\b(?!_?\*)")


def _read_by_the_code() -> set[str]:
    found = set()
    for folder in READERS:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".sh", ".yaml", ".yml"} and path.is_file():
                found |= set(VARIABLE.findall(path.read_text()))
    # prefixes written as QUILT_GEN_* or QUILT_TENANT_ in prose are not variables
    return {v for v in found if not v.endswith("_")}


def test_every_variable_the_code_reads_is_in_the_configuration_reference():
    page = docs_pages.configuration_page()
    documented = set(re.findall(r"^\| `(QUILT_[A-Z0-9_]+)` \|", page, re.M))
    missing = sorted(v for v in _read_by_the_code() - documented
                     if not any(d.startswith(v + "_") for d in documented))  # a prefix such as QUILT_S3
    assert missing == []


def test_every_setting_says_what_it_means():
    page = docs_pages.configuration_page()
    rows = [line for line in page.splitlines() if line.startswith("| `QUILT_")]
    assert len(rows) > 100
    assert [r for r in rows if r.rstrip().endswith("|  |")] == []


def test_the_site_builds_strictly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NO_MKDOCS_2_WARNING": "1",
                              "DISABLE_MKDOCS_2_WARNING": "true", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()
    assert (tmp_path / "site" / "architecture" / "index.html").exists()
