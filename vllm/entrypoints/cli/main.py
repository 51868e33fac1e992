"""The ``vllm`` command: ``vllm serve [MODEL] [flags]``, ``vllm bench serve [flags]``, and
the terminal clients ``vllm chat`` / ``vllm complete``, and ``vllm run-batch``."""

from __future__ import annotations

import argparse
import sys


def make_parser() -> argparse.ArgumentParser:
    from vllm import __version__
    from vllm.entrypoints.cli.benchmark import add_bench_parser
    from vllm.entrypoints.cli.clients import add_client_parsers
    from vllm.entrypoints.cli.run_batch import add_run_batch_parser
    from vllm.entrypoints.cli.serve import add_serve_parser

    parser = argparse.ArgumentParser(prog="vllm", description="vllm-continuum CLI")
    parser.add_argument("-v", "--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", metavar="{serve,bench,chat,complete,run-batch}")
    parser.serve_parser = add_serve_parser(sub)
    add_bench_parser(sub)
    add_client_parsers(sub)
    add_run_batch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.config_file import expand

    parser = make_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # vLLM's --config FILE.yaml: the file's flags
        try:
            argv = ["serve", *expand(argv[1:], parser.serve_parser)]
        except ValueError as e:
            parser.serve_parser.error(str(e))
        # Parsers registered by plugins are choices of --tool-call-parser: import
        # them, then build the parser again.
        from vllm.entrypoints.openai.parser_plugins import import_parser_plugin, plugin_paths

        if paths := plugin_paths(argv[1:]):
            try:
                for path in paths:
                    import_parser_plugin(path)
            except ValueError as e:
                parser.serve_parser.error(str(e))
            parser = make_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        sys.exit(2)
    args.func(args, parser)


if __name__ == "__main__":
    main()
