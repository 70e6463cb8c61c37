"""``inflight COMMAND ...`` (the console script) and ``python -m inflight COMMAND ...``.

A command's module is imported only when that command runs: ``inflight --help`` loads neither torch nor Ray.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (its module, whose main(argv, prog) runs it; one line of help)
COMMANDS = {
    "serve": ("inflight.serve_app.cli", "serve a model's OpenAI-compatible API on Ray Serve (like `vllm serve`)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight", description="inflight: an LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)  # the command's own parser has the help
    namespace, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    module = importlib.import_module(COMMANDS[namespace.command][0])
    return module.main(rest, prog=f"inflight {namespace.command}")


if __name__ == "__main__":
    sys.exit(main())
