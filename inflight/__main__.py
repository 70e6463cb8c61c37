"""``inflight COMMAND ...`` (the console script) and ``python -m inflight COMMAND ...``.

A command's module is imported only when that command runs: ``inflight --help`` loads neither torch nor Ray.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (its module[:function], whose main(argv, prog) runs it; one line of help)
COMMANDS = {
    "serve": ("inflight.serve_app.cli", "serve a model's OpenAI-compatible API on Ray Serve (like `vllm serve`)"),
    "profile": ("inflight.serve_app.sim.cli:profile_main",
                "measure what an engine step costs on this machine, for `inflight simulate`"),
    "simulate": ("inflight.serve_app.sim.cli:simulate_main",
                 "replay a trace through the scheduler and router across N simulated replicas; size a fleet"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight", description="inflight: an LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)  # the command's own parser has the help
    namespace, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    module_name, _, function = COMMANDS[namespace.command][0].partition(":")
    run = getattr(importlib.import_module(module_name), function or "main")
    return run(rest, prog=f"inflight {namespace.command}")


if __name__ == "__main__":
    sys.exit(main())
