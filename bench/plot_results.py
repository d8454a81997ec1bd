"""Plots of the benchmarks' kept results: docs/benchmarks/results/<name>.jsonl -> docs/benchmarks/plots/<name>.png.

    python bench/plot_results.py [NAME ...]      # every benchmark with results, or the ones named

A run is one JSON object a line: {"date", "machine", "command", "figures"}. Figures that are lists
against a list named as the first key (`tenants` for trainer_fusion) are drawn as lines, one per
run; scalar figures as bars per run, one panel per figure (nested objects are flattened as
`outer.inner`; figures that are 0 in every run are named in the title instead). The benchmark pages
(scripts/docs_pages.py) show the PNG next to the table.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks" / "results"
PLOTS = ROOT / "docs" / "benchmarks" / "plots"


def _flatten(figures: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in figures.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def plot(name: str) -> Path:
    runs = [json.loads(line) for line in (RESULTS / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    flat = [_flatten(run["figures"]) for run in runs]
    labels = [f"{run['date']}\n{run['machine'][:28]}" for run in runs]
    series = [k for k in flat[0] if isinstance(flat[0][k], list)]
    scalars = sorted({k for f in flat for k, v in f.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    zeros = [k for k in scalars if all(f.get(k, 0) == 0 for f in flat)]  # named in the title, not drawn
    panels = series[1:] if series else [k for k in scalars if k not in zeros]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        if series:
            for f, label in zip(flat, labels):
                if key in f:
                    ax.plot(f[series[0]], f[key], marker="o", label=label.replace("\n", ", "))
            ax.set_xscale("log", base=2)
            ax.set_xlabel(series[0])
            ax.legend(fontsize=6)
        else:
            ax.bar(range(len(flat)), [f.get(key, 0) for f in flat])
            ax.set_xticks(range(len(flat)), labels, fontsize=6)
        ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"bench/{name}" + (f" (0 in every run: {', '.join(zeros)})" if zeros and not series else ""),
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    PLOTS.mkdir(parents=True, exist_ok=True)
    out = PLOTS / f"{name}.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="benchmarks to plot (default: every one with results)")
    names = parser.parse_args().names or sorted(p.stem for p in RESULTS.glob("*.jsonl"))
    drawn = [str(plot(name).relative_to(ROOT)) for name in names]
    print(json.dumps({"plots": drawn}))


if __name__ == "__main__":
    main()
