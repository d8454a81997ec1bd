"""The benchmarks' two-column tables: label, value."""

from __future__ import annotations


def print_rows(rows: list[tuple[str, str]], indent: str = "") -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{indent}{k.ljust(width)}  {v}")
