"""benchmarks.peers.serve_vs_llamacpp: llama-server's command line, ours' configs, the BF16 file, the ratios and
issue 48's targets from given turns (no server started, no llama.cpp needed)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from benchmarks.peers import serve_vs_llamacpp as llamacpp
from benchmarks.peers import serve_vs_vllm
from inflight.engine.models.packaged import SMOLLM2, packaged_model_path


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_llama_server_runs_with_the_issues_settings():
    argv = llamacpp.llamacpp_server_argv("/bin/llama-server", "/models/m.gguf", "smollm2-135m-instruct")
    assert argv[0] == "/bin/llama-server" and flag_value(argv, "-m") == "/models/m.gguf"
    assert flag_value(argv, "--host") == "127.0.0.1" and flag_value(argv, "--port") == "8001"
    assert flag_value(argv, "-a") == "smollm2-135m-instruct"  # the client asks for our served name
    assert flag_value(argv, "-np") == "64" and "-kvu" in argv and flag_value(argv, "-c") == "65536"
    assert flag_value(argv, "-t") == "1" and flag_value(argv, "-tb") == "1"
    assert llamacpp.PORTS["llamacpp"] == llamacpp.PORTS["llamacpp-bf16"] == 8001
    assert llamacpp.PORTS["ours"] == llamacpp.PORTS["ours-bf16"] == serve_vs_vllm.PORTS["ours"]


def test_ours_keeps_the_file_quantized_and_ours_bf16_dequantizes_it():
    for system, quantization, dtype in (("ours", "auto", "float32"), ("ours-bf16", "none", "bfloat16")):
        config = yaml.safe_load(serve_vs_vllm.bench_config(
            "smollm2-135m-instruct", None, "smollm2-135m-instruct", llamacpp.ours_dtype(system, "float32"),
            llamacpp.ours_engine_args(system)))
        engine_args = config["applications"][0]["args"]["engine_args"]
        assert engine_args["quantization"] == quantization and engine_args["dtype"] == dtype
        # serve_vs_vllm's sizes otherwise: 8,000 tokens of KV, 64 slots, one thread on CPU 0
        assert engine_args["num_kv_blocks"] * engine_args["block_size"] == 8000
        assert engine_args["max_num_seqs"] == 64 and engine_args["num_threads"] == 1
        assert config["applications"][0]["args"]["engine_cpus"] == "0"
    assert llamacpp.ours_dtype("ours", "bfloat16") == "bfloat16"


def test_the_binary_from_the_flag_then_the_environment_then_the_build(tmp_path):
    binaries = []
    for name in ("flag", "env", "default"):
        path = tmp_path / name / "llama-server"
        path.parent.mkdir()
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
        binaries.append(path)
    flag, env, default = binaries
    environ = {llamacpp.LLAMACPP_BIN_ENV: str(env)}
    assert llamacpp.resolve_llamacpp_bin(str(flag), environ, default) == flag
    assert llamacpp.resolve_llamacpp_bin(None, environ, default) == env
    assert llamacpp.resolve_llamacpp_bin(None, {}, default) == default
    with pytest.raises(ValueError, match="make peer-llamacpp"):
        llamacpp.resolve_llamacpp_bin(None, {}, tmp_path / "none" / "llama-server")
    assert llamacpp.DEFAULT_LLAMACPP_BIN == llamacpp.ROOT / ".peer-llamacpp" / "build" / "bin" / "llama-server"


def test_the_bf16_file_is_made_once_by_llama_quantize_and_reused(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    quantize = bin_dir / "llama-quantize"  # a stand-in: records its argv, copies IN to OUT
    quantize.write_text(f'#!/bin/sh\necho "$@" >> {calls}\ncp "$2" "$3"\n')
    quantize.chmod(quantize.stat().st_mode | stat.S_IEXEC)
    source = tmp_path / "m.Q4_1.gguf"
    source.write_bytes(b"GGUF weights")
    cache = tmp_path / "cache"
    made = llamacpp.bf16_gguf(source, cache, bin_dir / "llama-server")
    assert made.read_bytes() == b"GGUF weights" and made.parent == cache and "BF16" in made.name
    assert llamacpp.bf16_gguf(source, cache, bin_dir / "llama-server") == made  # reused: not made again
    lines = calls.read_text().splitlines()
    assert len(lines) == 1 and lines[0].split()[0] == "--allow-requantize" and lines[0].split()[-1] == "BF16"
    assert [p.name for p in cache.iterdir()] == [made.name]  # no temporary file left behind
    os.utime(source, ns=(0, 0))  # a changed source gets a new file
    assert llamacpp.bf16_path(source, cache) != made


def test_a_failed_llama_quantize_leaves_no_file(tmp_path):
    quantize = tmp_path / "llama-quantize"
    quantize.write_text('#!/bin/sh\necho "no such type" >&2\nexit 1\n')
    quantize.chmod(0o755)
    source = tmp_path / "m.gguf"
    source.write_bytes(b"x")
    with pytest.raises(RuntimeError, match="no such type"):
        llamacpp.bf16_gguf(source, tmp_path / "cache", tmp_path / "llama-server")
    assert list((tmp_path / "cache").iterdir()) == []


def turn(system: str, round_index: int, tok_s: float, ttft: float, tpot: float, failed: int = 0) -> dict:
    def part(tok_s_value: float) -> dict:
        return {"completed": 4 - failed, "failed": failed, "output_throughput": tok_s_value, "mean_e2el_ms": 1000.0,
                "median_ttft_ms": ttft, "median_tpot_ms": tpot, "median_itl_ms": tpot}
    return {"system": system, "round": round_index, "concurrent": part(tok_s), "one_stream": part(tok_s / 10)}


def four_systems(ours_failed: int = 0) -> list[dict]:
    return [turn("ours", 0, 90.0, 200.0, 10.0, ours_failed), turn("ours", 1, 110.0, 300.0, 14.0),
            turn("llamacpp", 0, 20.0, 2000.0, 16.0), turn("llamacpp", 1, 30.0, 1800.0, 14.0),
            turn("ours-bf16", 0, 100.0, 250.0, 40.0), turn("llamacpp-bf16", 0, 25.0, 1000.0, 30.0)]


def test_ratios_are_ours_over_the_peer_in_the_same_dtype_from_the_means_over_rounds():
    found = llamacpp.ours_over_llamacpp(four_systems())
    assert found == pytest.approx({
        "ours / llamacpp: concurrent.output_throughput": 100.0 / 25.0,
        "ours / llamacpp: one_stream.median_ttft_ms": 250.0 / 1900.0,
        "ours / llamacpp: one_stream.median_tpot_ms": 12.0 / 15.0,
        "ours-bf16 / llamacpp-bf16: concurrent.output_throughput": 100.0 / 25.0,
        "ours-bf16 / llamacpp-bf16: one_stream.median_ttft_ms": 250.0 / 1000.0,
        "ours-bf16 / llamacpp-bf16: one_stream.median_tpot_ms": 40.0 / 30.0})
    # only the pairs that ran: the default two systems give ours / llamacpp alone
    assert set(llamacpp.ours_over_llamacpp(four_systems()[:4])) == {
        k for k in found if k.startswith("ours / llamacpp:")}


def test_targets_of_issue_48():
    met = llamacpp.targets(four_systems())
    assert met == {"ours / llamacpp: one_stream.median_tpot_ms <= 1.0": True,
                   "ours / llamacpp: one_stream.median_ttft_ms <= 1.0": True,
                   "ours / llamacpp: concurrent.output_throughput >= 3.0": True,
                   "ours-bf16 / llamacpp-bf16: one_stream.median_tpot_ms <= 1.0": False,  # 40 ms against 30
                   "no failed request of ours": True}
    assert not llamacpp.targets(four_systems(ours_failed=1))["no failed request of ours"]
    slow = [turn("ours", 0, 50.0, 200.0, 10.0), turn("llamacpp", 0, 20.0, 2000.0, 16.0)]  # x2.5 tok/s: short of x3
    assert not llamacpp.targets(slow)["ours / llamacpp: concurrent.output_throughput >= 3.0"]
    assert llamacpp.targets([turn("llamacpp", 0, 20.0, 2000.0, 16.0)]) == {}  # nothing to compare


def test_the_rounds_alternate_the_systems():
    order = []

    def one(system: str, round_index: int) -> dict:
        order.append((round_index, system))
        return turn(system, round_index, 1.0, 1.0, 1.0)

    turns = serve_vs_vllm.alternate(["ours", "llamacpp"], 3, 64, one)
    assert order == [(0, "ours"), (0, "llamacpp"), (1, "llamacpp"), (1, "ours"), (2, "ours"), (2, "llamacpp")]
    assert [t["system"] for t in turns] == [s for _, s in order]


def test_flags():
    try:
        gguf = packaged_model_path(SMOLLM2)
    except ValueError as e:
        pytest.skip(str(e))
    _, args = llamacpp.parse_args([])
    assert args.systems == ["ours", "llamacpp"] and args.dtype == "bfloat16"
    assert args.bench_model.gguf_file == Path(gguf)
    _, args = llamacpp.parse_args(["--systems", "ours,llamacpp,ours-bf16,llamacpp-bf16", "--dtype", "float32"])
    assert args.systems == ["ours", "llamacpp", "ours-bf16", "llamacpp-bf16"] and args.dtype == "float32"
    for argv in (["--systems", "ours,vllm"], ["--model", "bench-random"]):
        with pytest.raises(SystemExit):
            llamacpp.parse_args(argv)


def test_our_configs_are_checked_before_any_server_starts():
    import dataclasses
    from types import SimpleNamespace

    from inflight.engine.config import EngineConfig

    model = SimpleNamespace(engine_model="smollm2-135m-instruct", served_name="smollm2-135m-instruct")
    llamacpp.check_ours(["llamacpp", "llamacpp-bf16"], model, "bfloat16")  # nothing of ours to check
    if "quantization" in {f.name for f in dataclasses.fields(EngineConfig)}:
        llamacpp.check_ours(["ours", "ours-bf16"], model, "bfloat16")
    else:  # an engine before issue 48's `quantization`: refused at once, not once Ray runs
        with pytest.raises(ValueError, match="quantization"):
            llamacpp.check_ours(["ours"], model, "bfloat16")
