"""``inflight`` (the console script) and ``inflight serve``'s flags, without Ray: every config field is a flag with
its default, bad values stop before Ray starts in one line, ``inflight --help`` stays light.

Serving through the command: tests/serving/test_cli.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.engine.config import EngineConfig
from inflight.serve_app import cli
from inflight.serve_app.config import AppConfig

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
# Where a regression let a bad value through, the command would go on to Ray: this address fails fast instead of
# starting a cluster (nothing listens on port 1).
NO_CLUSTER = ["--address", "127.0.0.1:1"]


def run_inflight(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "inflight", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def expected_fields() -> dict[str, object]:
    """Every field that must have a flag, with its default (the model is the positional MODEL)."""
    engine = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    app = {name: info.get_default(call_default_factory=True) for name, info in AppConfig.model_fields.items()
           if name not in ("model", "engine_args")}  # engine_args: the engine's fields, each a flag
    assert not set(engine) & set(app)
    return {**engine, **app}


def test_serve_help_lists_every_engine_and_app_field_with_its_default():
    result = run_inflight("serve", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines anywhere between words
    missing, wrong = [], []
    for name, default in expected_fields().items():
        flag = "--" + name.replace("_", "-")
        match = re.search(rf"(?<![\w-]){re.escape(flag)}[ ,]", text)
        if match is None:
            missing.append(flag)
            continue
        # the flag's help ends with its default; the next "(default: " after the flag is its own
        shown = text[text.index("(default: ", match.end()) + len("(default: "):]
        want = default if isinstance(default, str) else json.dumps(default)
        if not shown.startswith(want + ")"):
            wrong.append(f"{flag}: {shown[:40]!r}, want {want!r}")
    assert not missing, f"no flag for {missing}"
    assert not wrong, wrong
    assert f"(default: {AppConfig.model_fields['model'].default})" in text  # MODEL's
    assert "--no-enable-prefix-caching" in text  # bools as --flag/--no-flag


def test_inflight_help_loads_neither_torch_nor_ray():
    script = ("import sys\nfrom inflight.__main__ import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n"
              "    assert e.code == 0, e.code\nprint(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_console_script_names_a_callable_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["inflight"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))


@pytest.mark.parametrize("args, flag", [
    (["demo-tiny", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-seqs", "many"], "--max-num-seqs"),
    (["--speculative-config", '{"method": "guess"}'], "--speculative-config"),
    (["--max-queue-wait-s", "0"], "--max-queue-wait-s"),
    (["--routing-policy", "random"], "--routing-policy"),
    (["--engine-cpus", "first"], "--engine-cpus"),
    (["--max-pending-requests", "0"], "--max-pending-requests"),
    (["--num-replicas", "0"], "--num-replicas"),
    (["--config", "configs/demo-tiny.yaml", "--max-model-len", "-5"], "--max-model-len"),
])
def test_a_bad_value_stops_before_ray_in_one_line_naming_its_flag(args, flag):
    result = run_inflight("serve", *args, *NO_CLUSTER)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("inflight serve: error: ") and flag in last, result.stderr


def test_an_unknown_flag_is_argparses_usage_error():
    result = run_inflight("serve", "demo-tiny", "--max-num-sequences", "8", *NO_CLUSTER)
    assert result.returncode == 2
    assert "unrecognized arguments: --max-num-sequences" in result.stderr
    assert run_inflight("bogus").returncode == 2


def test_flags_make_a_one_app_config_and_override_a_config_files_apps():
    parser = cli.build_parser()
    config = cli.serve_config_from(parser.parse_args(["demo-tiny", "--max-num-seqs", "8", "--no-engine-process",
                                                      "--speculative-config", '{"method": "ngram"}']))
    [app] = config["applications"]
    assert app["import_path"] == cli.BUILDER and app["name"] == cli.APP_NAME
    # only what was given: the classes' defaults stay theirs
    assert app["args"] == {"model": "demo-tiny", "engine_process": False,
                           "engine_args": {"max_num_seqs": 8, "speculative_config": {"method": "ngram"}}}

    config = cli.serve_config_from(parser.parse_args(["--config", "configs/demo-tiny.yaml", "--max-num-seqs", "8",
                                                      "--num-replicas", "auto", "--proxy-port", "9100"]))
    args = config["applications"][0]["args"]
    assert args["engine_args"]["max_num_seqs"] == 8 and args["engine_args"]["max_model_len"] == 2048  # file's kept
    assert args["num_replicas"] == "auto" and args["model"] == "demo-tiny"
    assert config["http_options"] == {"host": "127.0.0.1", "port": 9100}


def test_field_comments_become_help():
    from inflight.serve_app.cli_args import field_comments

    comments = field_comments(EngineConfig)
    assert comments["max_model_len"] == "None: the model's own limit"  # beside the field
    assert comments["scheduling_policy"].startswith("Who goes first.")  # the lines above it
    assert comments["seed"] == ""
