"""benchmarks.peers.serve_vs_vllm: the configs it serves ours with (the servers themselves run in the benchmark)."""

from __future__ import annotations

from pathlib import Path

import yaml

from benchmarks.peers import serve_vs_vllm
from inflight.serve_app.config import AppConfig
from inflight.serve_app.cpu_plan import serving_cpus

CHECKPOINT = Path("/models/bench")


def test_the_default_system_serves_the_config_as_written():
    config = yaml.safe_load(serve_vs_vllm.bench_config(CHECKPOINT))
    args = AppConfig.model_validate(config["applications"][0]["args"])
    assert args.model == str(CHECKPOINT)
    assert args.engine_args["num_threads"] == 1 and args.engine_cpus == "0"
    assert serving_cpus(config, {0, 1}) == {1}  # Ray's processes on the other core


def test_all_cpus_computes_with_more_threads_and_lets_ray_share_every_cpu():
    config = yaml.safe_load(serve_vs_vllm.bench_config(CHECKPOINT, 3))
    args = AppConfig.model_validate(config["applications"][0]["args"])
    assert args.model == str(CHECKPOINT)
    assert args.engine_args["num_threads"] == 3 and args.engine_cpus is None
    assert args.engine_args["one_thread_max_tokens"] == serve_vs_vllm.ONE_THREAD_MAX_TOKENS  # few streams: one
    assert serving_cpus(config, {0, 1, 2}) is None  # no CPU of the engine's own: Ray is not pinned away from it
    # everything else is the written config's
    written = yaml.safe_load(serve_vs_vllm.bench_config(CHECKPOINT))
    del written["applications"][0]["args"]["engine_cpus"]
    for each in (written, config):
        del each["applications"][0]["args"]["engine_args"]["num_threads"]
    del config["applications"][0]["args"]["engine_args"]["one_thread_max_tokens"]
    assert config == written


def test_every_system_has_a_port():
    assert {"ours", "ours-all-cpus", "vllm", "vllm-all-cpus"} <= set(serve_vs_vllm.PORTS)


def test_both_servers_get_the_dtype():
    config = yaml.safe_load(serve_vs_vllm.bench_config(CHECKPOINT, None, dtype="bfloat16"))
    assert config["applications"][0]["args"]["engine_args"]["dtype"] == "bfloat16"
    config = yaml.safe_load(serve_vs_vllm.bench_config(CHECKPOINT, 2, dtype="bfloat16"))
    assert config["applications"][0]["args"]["engine_args"]["dtype"] == "bfloat16"
    assert config["applications"][0]["args"]["engine_args"]["num_threads"] == 2
