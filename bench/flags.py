"""A benchmark's model parameters (a frozen dataclass with defaults) as command-line flags."""

from __future__ import annotations

import argparse
import dataclasses


def add_flags(ap: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """One `--field-name` flag per field of `cls`, typed and defaulted as the field."""
    for f in dataclasses.fields(cls):
        if f.name not in skip:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)


def from_flags(args: argparse.Namespace, cls, skip: tuple[str, ...] = (), **given):
    """`cls` built from the parsed flags (the skipped fields from `given`)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in skip}, **given)
