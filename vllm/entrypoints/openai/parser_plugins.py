"""``--tool-parser-plugin`` and ``--reasoning-parser-plugin`` (vLLM's): a Python file (or an
importable module name) whose import registers more parsers, e.g.::

    from vllm.entrypoints.openai.tool_parsers import ToolParser, register_tool_parser

    @register_tool_parser("my_format")
    class MyToolParser(ToolParser): ...

after which ``--tool-call-parser my_format`` selects it. As in vLLM the plugin is tried as
a module name first, then as a file (its module named after the file). The flags'
``choices`` come from the registries when the parser is built, so ``vllm serve`` imports
the plugins named on its command line (or in its ``--config`` file) first, then builds
the parser: an unknown name still fails at start-up with the list of names. Unlike vLLM,
a plugin that fails to import stops the start (vLLM logs it and goes on).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

PLUGIN_FLAGS = ("--tool-parser-plugin", "--reasoning-parser-plugin")
_loaded: dict[str, ModuleType] = {}  # by the path or name given: a second import re-registers


def import_parser_plugin(path: str) -> ModuleType:
    """Import the plugin ``path`` once per process (``ValueError`` if it cannot be)."""
    key = os.path.abspath(path) if os.path.isfile(path) else path
    if key in _loaded:
        return _loaded[key]
    try:
        module = importlib.import_module(path)
    except (ModuleNotFoundError, TypeError):
        module = _import_file(path)
    logger.info("Loaded parser plugin %s", path)
    _loaded[key] = module
    return module


def _import_file(path: str) -> ModuleType:
    if not os.path.isfile(path):
        raise ValueError(f"parser plugin {path!r}: no such module or file")
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"parser plugin {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ValueError(f"parser plugin {path!r} failed to import: {e!r}") from e
    return module


def plugin_paths(argv: Sequence[str]) -> list[str]:
    """The values of the plugin flags in a command line (``--flag X`` or ``--flag=X``)."""
    paths = []
    for i, arg in enumerate(argv):
        for flag in PLUGIN_FLAGS:
            if arg == flag and i + 1 < len(argv):
                paths.append(argv[i + 1])
            elif arg.startswith(flag + "="):
                paths.append(arg[len(flag) + 1 :])
    return [p for p in paths if p]


def load_parser_plugins(frontend: Any) -> None:
    """Import the plugins a ``FrontendArgs`` names (an API server process that did not
    parse the command line itself, e.g. one of ``--api-server-count N``)."""
    for path in (frontend.tool_parser_plugin, frontend.reasoning_parser_plugin):
        if path:
            import_parser_plugin(path)
