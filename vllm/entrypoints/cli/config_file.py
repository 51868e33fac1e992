"""``vllm serve --config FILE.yaml``: flags from a YAML file, as vLLM reads them.

Each key is a flag's long name (``max-model-len`` or ``max_model_len``) and its value the
flag's: ``true`` sets a switch and ``false`` clears it (its ``--no-`` form), a list gives
a flag's several values, a mapping becomes the JSON object a ``*-config`` flag takes, and
anything else is the flag's text. ``model`` names the model. The file's flags go before
the command line's, so a flag given on both wins from the command line (and the
positional model over the file's ``model``): command line > file > defaults.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def config_path(argv: list[str]) -> tuple[str, int, int] | None:
    """The ``--config`` value in ``argv`` and the slice ``[start, end)`` it spans, or
    None. ``ValueError`` if it is given twice or without a value."""
    found = []
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ValueError("--config needs a YAML file")
            found.append((argv[i + 1], i, i + 2))
        elif arg.startswith("--config="):
            found.append((arg.split("=", 1)[1], i, i + 1))
    if len(found) > 1:
        raise ValueError("--config is given more than once")
    return found[0] if found else None


def load_config_file(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags ``path`` holds, as command-line arguments of ``parser``; ``ValueError``
    naming the file and the key for anything the parser would not take."""
    if Path(path).suffix not in (".yaml", ".yml"):
        raise ValueError(f"--config {path}: the file must be YAML (.yaml or .yml)")
    import yaml

    try:
        config = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({e})") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: the file must hold a mapping of flags to values")
    options = parser._option_string_actions
    args: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config" or flag not in options:
            raise ValueError(f"--config {path}: unknown flag {key!r}")
        args += _as_args(flag, value, options, path)
    return args


def _as_args(flag: str, value: Any, options: dict, path: str) -> list[str]:
    """One key's value as the flag's arguments."""
    if isinstance(value, bool):
        if value:
            return [flag]
        negated = "--no-" + flag[2:]
        if negated in options:
            return [negated]
        if options[flag].nargs == 0:  # a switch with no off form: false is its default
            return []
        return [flag, "false"]
    if isinstance(value, list):
        return [flag, *(_scalar(v) for v in value)] if value else []
    if value is None:
        raise ValueError(f"--config {path}: {flag[2:]} has no value")
    return [flag, _scalar(value)]


def _scalar(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def expand(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` (a subcommand's arguments, after its name) with ``--config FILE``
    replaced: the file's flags first, then the rest as given."""
    found = config_path(argv)
    if found is None:
        return argv
    path, start, end = found
    rest = [*argv[:start], *argv[end:]]
    # A leading positional (the model) goes first: after the file's flags, a flag of
    # several values would take it as one of them.
    lead = rest[:1] if rest and not rest[0].startswith("-") else []
    return [*lead, *load_config_file(path, parser), *rest[len(lead) :]]
