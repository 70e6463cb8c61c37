"""engine_cpus: a CPU list for each replica's engine process, and the CPUs left to Ray's processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.engine.cpu_list import format_cpu_list, parse_cpu_list
from inflight.serve_app.config import AppConfig
from inflight.serve_app.cpu_plan import serving_cpus

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, cpus", [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0,2,4-5", {0, 2, 4, 5}), (" 1 , 3", {1, 3})])
def test_cpu_lists_parse_and_format_back(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "0,,1", "1.5"])
def test_a_bad_cpu_list_is_a_value_error_naming_engine_cpus(text):
    with pytest.raises(ValueError, match="engine_cpus"):
        parse_cpu_list(text)
    with pytest.raises(ValueError, match="engine_cpus"):
        AppConfig.model_validate({"engine_cpus": text})


def test_engine_cpus_need_the_engine_process():
    with pytest.raises(ValueError, match="engine_process"):
        AppConfig.model_validate({"engine_cpus": "0", "engine_process": False})


def test_ray_gets_the_cpus_the_engines_leave():
    config = {"applications": [{"args": {"engine_cpus": "0"}}, {"args": {"engine_cpus": "2-3"}}, {"args": {}}]}
    assert serving_cpus(config, {0, 1, 2, 3, 4}) == {1, 4}
    assert serving_cpus({"applications": [{"args": {}}]}, {0, 1}) is None  # nothing reserved: no pinning
    assert serving_cpus(config, {0, 2, 3}) is None  # nothing would be left: no pinning either


@pytest.mark.parametrize("config, reserved", [("bench-vs-vllm.yaml", {0}), ("demo.yaml", set())])
def test_the_command_prints_a_taskset_list_for_a_config(config, reserved):
    done = subprocess.run([sys.executable, "-m", "inflight.serve_app.cpu_plan", str(ROOT / "configs" / config)],
                          capture_output=True, text=True, cwd=ROOT, check=True)
    rest = set(os.sched_getaffinity(0)) - reserved
    expected = format_cpu_list(rest) if reserved and rest else ""
    assert done.stdout.strip() == expected
