"""The `quilt` parser keeps its shape: every command, flag, default, type, choice and help text, as
they were before the commands became a table (`stack.cli.COMMANDS`). The golden file was dumped
from the parser built by hand; a change to the CLI that is meant regenerates it:

    python -c "from tests.test_cli_parser import write_golden; write_golden()"
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from bases.architectures import SUPPORTED
from stack.cli import build_parser
from stack.tiny_model import buildable_architectures

GOLDEN = Path(__file__).with_name("quilt_cli_parser.json")

# Read when the parser is built (stack.cli's `up` defaults); unset, so the dump is the same anywhere.
ENV_DEFAULTS = ("QUILT_HOST", "QUILT_PORT", "QUILT_GEN_REPLICAS", "QUILT_TRAINER_SHARDS", "QUILT_TRAINER_RANKS")


def _value(value):
    """A default, type or const as JSON: a function by its qualified name, a path as text."""
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    if isinstance(value, Path):
        return str(value)
    return value


def structure(parser: argparse.ArgumentParser, into: dict | None = None) -> dict:
    """Everything argparse keeps of a parser that parsing or --help depends on, for it and each of
    its subcommands' parsers: {prog: {"parser": ..., "actions": [...]}}, a subcommand by its prog."""
    into = {} if into is None else into
    actions = []
    for action in parser._actions:
        entry = {"class": type(action).__name__, "option_strings": action.option_strings, "dest": action.dest,
                 "default": _value(action.default), "type": _value(action.type), "nargs": action.nargs,
                 "required": action.required, "help": action.help, "metavar": action.metavar,
                 "const": _value(action.const)}
        if isinstance(action, argparse._SubParsersAction):
            entry["choices"] = {name: sub.prog for name, sub in action.choices.items()}
            entry["choice_help"] = {choice.dest: choice.help for choice in action._choices_actions}
        else:
            entry["choices"] = list(action.choices) if action.choices is not None else None
            if entry["choices"] == buildable_architectures():  # grows with bases.architectures, not with the CLI
                entry["choices"] = "stack.tiny_model.buildable_architectures()"
        actions.append(entry)
    into[parser.prog] = {
        "parser": {"description": parser.description, "usage": parser.usage,
                   "defaults": {key: _value(value) for key, value in parser._defaults.items()},
                   "groups": [[group.title, [a.dest for a in group._group_actions]] for group in parser._action_groups],
                   "exclusive": [[group.required, [a.dest for a in group._group_actions]]
                                 for group in parser._mutually_exclusive_groups]},
        "actions": actions}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                structure(sub, into)
    return into


def _dump() -> dict:
    saved = {name: os.environ.pop(name) for name in ENV_DEFAULTS if name in os.environ}
    try:
        return json.loads(json.dumps(structure(build_parser())))
    finally:
        os.environ.update(saved)


def write_golden() -> None:
    """Rewrite the golden file from the parser as it is now: one line per parser and per action,
    so a change to one flag is a one-line diff."""
    lines = []
    for prog, entry in _dump().items():
        actions = ",\n  ".join(json.dumps(action) for action in entry["actions"])
        lines.append(f' {json.dumps(prog)}: {{\n  "parser": {json.dumps(entry["parser"])},\n  "actions": [\n  '
                     f'{actions}]}}')
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")


def test_the_parser_is_the_one_the_golden_file_holds():
    assert _dump() == json.loads(GOLDEN.read_text())


@pytest.mark.parametrize(("name", "value", "dest", "expected"), [
    ("QUILT_PORT", "9001", "port", 9001),
    ("QUILT_HOST", "0.0.0.0", "host", "0.0.0.0"),
    ("QUILT_TRAINER_SHARDS", "3", "trainer_shards", 3),
])
def test_up_reads_its_defaults_from_the_environment_when_the_parser_is_built(monkeypatch, name, value, dest,
                                                                              expected):
    monkeypatch.setenv(name, value)
    assert getattr(build_parser().parse_args(["up"]), dest) == expected


@pytest.mark.parametrize(("architecture", "accepted"), [
    ("qwen3_5_text", True), ("qwen3_5_moe_text", True), ("qwen3_vl", True),
    ("qwen3_5", False), ("qwen3_5_moe", False),  # multimodal configs a tiny spec cannot fill: argparse refuses them
])
def test_create_tiny_offers_only_the_architectures_a_tiny_model_is_built_of(architecture, accepted, capsys):
    argv = ["models", "create-tiny", "--architecture", architecture]
    if accepted:
        assert build_parser().parse_args(argv).architecture == architecture
        assert architecture in SUPPORTED
    else:
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert "invalid choice" in capsys.readouterr().err
