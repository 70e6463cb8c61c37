"""benchmarks.peers.vllm_baseline without vLLM: the KV sizes, the job, the peer's Python, the flags, and the
subprocess plumbing through a fake worker script that answers like the real one."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.common.workloads import MODEL_SHAPE, build_workload, warmup_workload
from benchmarks.offline import offline
from benchmarks.peers import vllm_baseline
from benchmarks.peers.vllm_baseline import (
    VllmSettings, build_job, checkpoint_kv_shape, kv_cache_sizes, resolve_peer_python, run_vllm,
)

REQUESTS = build_workload("seed", 3, prompt_lens=(5, 9), output_lens=(2, 4))
SETTINGS = VllmSettings(python=sys.executable)

# Answers like benchmarks/peers/vllm_offline.py: request i done at 0.1 * (i + 1) s with its output length
# (plus WRONG_TOKENS[i]); also reports its environment.
FAKE_WORKER = """
import json, os, sys
job = json.load(open(sys.argv[1]))
n = len(job["prompts"])
extra = {WRONG_TOKENS}
json.dump({"vllm_version": "0.0-fake", "done_s": [0.1 * (i + 1) for i in range(n)],
           "num_tokens": [m + extra.get(i, 0) for i, m in enumerate(job["output_lens"])],
           "num_gpu_blocks": job["num_gpu_blocks_override"],
           "kv_cache_size_tokens": job["num_gpu_blocks_override"] * job["block_size"],
           "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}},
          open(sys.argv[2], "w"))
"""


def write_checkpoint_config(path: Path) -> Path:
    """A checkpoint directory with the benchmark model's config.json: all the job reads of it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL_SHAPE))
    return path


def write_fake_worker(tmp_path: Path, wrong_tokens: dict[int, int] | None = None) -> Path:
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER.replace("{WRONG_TOKENS}", repr(wrong_tokens or {})))
    return worker


# -- KV sizes and the job ------------------------------------------------------------------------------------
def test_kv_cache_sizes_add_the_block_vllm_holds_back_and_size_exactly_those_blocks():
    layers, kv_heads, head_dim = 4, 4, 256 // 8  # the benchmark model
    assert kv_cache_sizes(8000, 32, layers, kv_heads, head_dim, 4) == (251, 251 * 2 * layers * 32 * kv_heads * head_dim * 4)
    assert kv_cache_sizes(8016, 32, layers, kv_heads, head_dim, 4)[0] == 252  # a part block counts whole
    assert kv_cache_sizes(8000, 32, layers, kv_heads, head_dim, 2)[1] == 251 * 2 * layers * 32 * kv_heads * head_dim * 2


def test_checkpoint_kv_shape_reads_config_json(tmp_path):
    assert checkpoint_kv_shape(write_checkpoint_config(tmp_path)) == (4, 4, 32)
    (tmp_path / "config.json").write_text(json.dumps({**MODEL_SHAPE, "head_dim": 64}))
    assert checkpoint_kv_shape(tmp_path) == (4, 4, 64)


def test_job_carries_the_workload_and_the_same_budget_as_ours(tmp_path):
    model = write_checkpoint_config(tmp_path / "model")
    job = build_job(model, REQUESTS, VllmSettings("py", dtype="bfloat16", enforce_eager=True), 8000, 64, 2048)
    json.dumps(job)  # the worker reads it as JSON
    assert job["prompts"] == [r.prompt_token_ids for r in REQUESTS]
    assert job["output_lens"] == [r.max_tokens for r in REQUESTS]
    assert job["warmup"] == {"prompts": [r.prompt_token_ids for r in warmup_workload()],
                             "output_lens": [r.max_tokens for r in warmup_workload()]}
    assert (job["model"], job["dtype"], job["enforce_eager"]) == (str(model), "bfloat16", True)
    assert (job["kv_budget_tokens"], job["block_size"], job["num_gpu_blocks_override"]) == (8000, 32, 251)
    assert job["kv_cache_memory_bytes"] == kv_cache_sizes(8000, 32, 4, 4, 32, 2)[1]
    assert (job["max_num_seqs"], job["max_num_batched_tokens"], job["max_model_len"]) == (64, 2048, 2048)
    # as ours: the step budget holds a token per slot at least
    assert build_job(model, REQUESTS, SETTINGS, 8000, 64, 16)["max_num_batched_tokens"] == 64


def test_sampling_flags_reach_our_requests_and_the_vllm_job(tmp_path):
    from benchmarks.common.workloads import request_params

    args, requests, _, _ = offline.parse_args(["--baselines", "vllm", "--vllm-python", sys.executable,
                                               "--num-requests", "3", "--temperature", "0.8", "--top-p", "0.9"])
    assert [(request_params(r).temperature, request_params(r).top_p) for r in requests] == [(0.8, 0.9)] * 3
    job = build_job(write_checkpoint_config(tmp_path / "model"), requests, SETTINGS, 8000, 64, 2048)
    assert json.loads(json.dumps(job))["sampling"] == [[0.8, 0.9]] * 3  # as the worker reads it
    _, greedy_requests, _, _ = offline.parse_args(["--num-requests", "2"])
    assert all(request_params(r).temperature == 0.0 and request_params(r).top_p == 1.0 for r in greedy_requests)


def test_requests_that_stop_at_end_of_sequence_may_get_fewer_tokens_from_vllm(tmp_path):
    """The chat workload's requests: vLLM is told not to ignore end of sequence for them, and what they got counts
    (at most max_tokens); the others still get exactly theirs. The warm-up draws from the model's ordinary tokens."""
    requests = [REQUESTS[0], dataclasses.replace(REQUESTS[1], ignore_eos=False)]
    job = build_job(write_checkpoint_config(tmp_path / "model"), requests, SETTINGS, 8000, 64, 2048,
                    token_range=(17, 49152), max_model_len=1024)
    assert job["ignore_eos"] == [True, False] and job["max_model_len"] == 1024
    assert min(min(p) for p in job["warmup"]["prompts"]) == 17
    exact = requests[0].max_tokens
    run = vllm_baseline.baseline_run({"done_s": [0.1, 0.2], "num_tokens": [exact, 1]}, requests, job, SETTINGS)
    assert run.output_tokens == [exact, 1]
    assert offline.from_baseline_run(run, requests).useful_tokens == exact + 1
    for wrong in ([exact - 1, 1], [exact, requests[1].max_tokens + 1], [exact, 0]):
        with pytest.raises(RuntimeError, match="vllm: 1 request"):
            vllm_baseline.baseline_run({"done_s": [0.1, 0.2], "num_tokens": wrong}, requests, job, SETTINGS)


# -- the peer's Python ---------------------------------------------------------------------------------------
def test_peer_python_is_the_flag_then_the_environment_then_the_repo_venv(tmp_path, monkeypatch):
    default = tmp_path / ".venv-vllm" / "bin" / "python"
    env = {"INFLIGHT_VLLM_PYTHON": sys.executable}
    assert resolve_peer_python("/bin/sh", env, default) == "/bin/sh"
    assert resolve_peer_python(None, env, default) == sys.executable
    with pytest.raises(ValueError, match=r"make peer-venv.*--vllm-python"):
        resolve_peer_python(None, {}, default)
    default.parent.mkdir(parents=True)
    default.symlink_to(sys.executable)
    assert resolve_peer_python(None, {}, default) == str(default)
    assert resolve_peer_python(None, {"INFLIGHT_VLLM_PYTHON": ""}, default) == str(default)
    with pytest.raises(ValueError, match="INFLIGHT_VLLM_PYTHON: /nowhere/python is not an executable"):
        resolve_peer_python(None, {"INFLIGHT_VLLM_PYTHON": "/nowhere/python"}, default)
    with pytest.raises(ValueError, match="--vllm-python"):
        resolve_peer_python(str(tmp_path), env, default)  # a directory
    # relative to where the command was typed (`INFLIGHT_VLLM_PYTHON=.venv-vllm/bin/python`), not to the worker's
    # own directory
    monkeypatch.chdir(tmp_path)
    assert resolve_peer_python(None, {"INFLIGHT_VLLM_PYTHON": ".venv-vllm/bin/python"}, tmp_path / "x") == str(default)
    monkeypatch.setattr(vllm_baseline, "PEER_VENV_PYTHON", tmp_path / "absent")  # the default's default
    monkeypatch.delenv("INFLIGHT_VLLM_PYTHON", raising=False)
    with pytest.raises(ValueError, match="make peer-venv"):
        resolve_peer_python(None)


# -- flags ---------------------------------------------------------------------------------------------------
def parse(*flags: str):
    return offline.parse_args(["--num-requests", "4", "--vllm-python", sys.executable, *flags])[0]


def test_baselines_vllm_adds_the_vllm_system_with_its_settings():
    args = parse("--batching", "continuous,static", "--baselines", "vllm", "--dtype", "float32")
    assert args.systems == ["continuous", "static", "vllm"]
    assert args.vllm == VllmSettings(sys.executable, "float32", "0-1", False)
    # by default vLLM runs in the dtype ours runs in: "auto" resolved once, for both
    args = parse("--baselines", "vllm")
    assert args.dtype in ("float32", "bfloat16") and args.vllm.dtype == args.dtype
    args = parse("--baselines", "hf,vllm", "--threads", "4", "--vllm-dtype", "bfloat16", "--vllm-eager")
    assert args.systems == ["continuous", "static", "hf-static", "hf-cb", "vllm"]
    assert args.vllm == VllmSettings(sys.executable, "bfloat16", "0-3", True)
    assert parse("--baselines", "vllm", "--threads", "1").vllm.threads_bind == "0"
    assert parse("--baselines", "vllm", "--vllm-threads-bind", "auto").vllm.threads_bind == "auto"
    assert parse("--baselines", "hf-cb,hf").systems == ["continuous", "static", "hf-cb", "hf-static"]
    args = parse("--baselines", "hf")
    assert args.systems == ["continuous", "static", "hf-static", "hf-cb"] and args.vllm is None


@pytest.mark.parametrize("flags", [
    ["--baselines", "vllm2"],
    ["--baselines", "none,vllm"],
    ["--baselines", ","],
    ["--baselines", "vllm", "--vllm-threads-bind", "0-1;true"],
    ["--baselines", "vllm", "--vllm-dtype", "float16"],
    ["--baselines", "vllm", "--rate", "2"],  # vLLM takes every request at t=0
    ["--workload", "prefill-only", "--baselines", "vllm"],
    ["--batching", "none"],
    ["--temperature", "-0.5"],
    ["--top-p", "0"],
    ["--top-p", "1.5"],
    ["--temperature", "1", "--baselines", "hf"],  # transformers' baselines decode greedily
    ["--top-p", "0.9", "--speculative", "ngram"],
])
def test_bad_flag_combinations_are_errors(flags):
    with pytest.raises(SystemExit):
        parse(*flags)


def test_baselines_vllm_without_a_peer_python_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vllm_baseline, "PEER_VENV_PYTHON", tmp_path / "absent")
    monkeypatch.delenv("INFLIGHT_VLLM_PYTHON", raising=False)
    with pytest.raises(SystemExit):
        offline.parse_args(["--baselines", "vllm"])
    assert "make peer-venv" in capsys.readouterr().err
    assert offline.parse_args(["--baselines", "hf"])[0].vllm is None  # not asked for, not looked for


# -- a run through a fake worker -----------------------------------------------------------------------------
def test_run_passes_the_job_to_the_worker_and_reads_back_a_baseline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    model = write_checkpoint_config(tmp_path / "model")
    run = run_vllm(model, REQUESTS, SETTINGS, 8000, 64, 2048, worker=write_fake_worker(tmp_path))
    assert run.system == "vllm" and run.computed_tokens is None
    assert run.latencies_s == pytest.approx([0.1, 0.2, 0.3]) and run.span_s == pytest.approx(0.3)
    extra = run.extra
    assert (extra["dtype"], extra["threads_bind"], extra["enforce_eager"]) == ("float32", "0-1", False)
    assert (extra["num_gpu_blocks_override"], extra["num_gpu_blocks"], extra["kv_cache_size_tokens"]) == (251, 251, 8032)
    assert extra["vllm_version"] == "0.0-fake"
    # the worker's environment: threads bound as set, the whole-GiB KV size gone
    assert extra["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert "251 blocks of 32 (8000 tokens usable" in vllm_baseline.describe_settings(extra)


def test_the_worker_runs_in_a_temporary_directory(tmp_path):
    model = write_checkpoint_config(tmp_path / "model")
    worker = tmp_path / "cwd_worker.py"
    worker.write_text(textwrap.dedent("""
        import json, os, sys
        job = json.load(open(sys.argv[1]))
        open(os.path.join(os.path.dirname(sys.argv[0]), "cwd.txt"), "w").write(os.getcwd())
        json.dump({"done_s": [1.0] * len(job["prompts"]), "num_tokens": job["output_lens"]}, open(sys.argv[2], "w"))
    """))
    run_vllm(model, REQUESTS, SETTINGS, 8000, 64, 2048, worker=worker)
    cwd = Path((tmp_path / "cwd.txt").read_text())
    assert cwd.name.startswith("inflight-vllm-") and cwd != Path(os.getcwd()) and not cwd.exists()


def test_a_request_with_the_wrong_number_of_tokens_fails_the_run(tmp_path):
    model = write_checkpoint_config(tmp_path / "model")
    wanted = REQUESTS[1].max_tokens
    with pytest.raises(RuntimeError, match=rf"1 request\(s\) got the wrong number of tokens \(request 1: "
                                           rf"{wanted - 1}, asked for {wanted}\)"):
        run_vllm(model, REQUESTS, SETTINGS, 8000, 64, 2048, worker=write_fake_worker(tmp_path, {1: -1}))


def test_a_failing_worker_fails_the_run_with_the_end_of_its_stderr(tmp_path):
    model = write_checkpoint_config(tmp_path / "model")
    worker = tmp_path / "failing_worker.py"
    worker.write_text("import sys\nprint('loading', flush=True)\n"
                      "print('\\n'.join(f'log {i}' for i in range(100)), file=sys.stderr)\n"
                      "raise SystemExit('RuntimeError: no KV blocks')\n")
    with pytest.raises(RuntimeError, match=r"exited with 1 and wrote no result") as failure:
        run_vllm(model, REQUESTS, SETTINGS, 8000, 64, 2048, worker=worker)
    message = str(failure.value)
    assert message.endswith("RuntimeError: no KV blocks") and "log 99" in message and "log 10\n" not in message


def test_offline_runs_vllm_as_a_system_and_compares_it_with_continuous(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vllm_baseline, "WORKER", write_fake_worker(tmp_path))
    args, requests, arrivals, _ = offline.parse_args(
        ["--num-requests", "3", "--prompt-lens", "5", "9", "--output-lens", "2", "4", "--batching", "continuous",
         "--baselines", "vllm", "--vllm-python", sys.executable])
    model = write_checkpoint_config(tmp_path / "model")
    vllm = offline.run_system("vllm", str(model), requests, arrivals, args)
    tokens = sum(r.max_tokens for r in requests)
    assert vllm.tokens_per_s == pytest.approx(tokens / 0.3)
    # our continuous run stood in by a result 1.2x as fast, with a mean latency 0.01 s higher than vLLM's
    ours = offline.SystemResult("continuous", 0.25, tokens, [0.11, 0.21, 0.31], None)
    results = {"continuous": ours, "vllm": vllm}
    ratio_rows, latency_rows = offline.ratios(results), offline.latency_comparisons(results)
    assert [(r["ratio"], r["target"], r["met"]) for r in ratio_rows] == [("continuous/vllm", 1.1, True)]
    assert [(r["ours"], r["theirs"], r["met"]) for r in latency_rows] == [("continuous", "vllm", False)]
    assert latency_rows[0]["mean_latency_s"] == pytest.approx(0.21)
    offline.print_report(results, {s: [r] for s, r in results.items()}, ratio_rows, latency_rows,
                         {"num_requests": 3, "prompt_tokens": 20, "output_tokens": tokens}, "seed", (None, None), args)
    out = capsys.readouterr().out
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1" in out and "torch.compile on" in out
    assert "mean latency: continuous 0.21 s, vllm 0.20 s; target continuous <= vllm: MISSED" in out


# -- vLLM stays out of our process ---------------------------------------------------------------------------
def test_the_worker_imports_only_the_standard_library_at_module_level():
    tree = ast.parse(vllm_baseline.WORKER.read_text())
    top_level = []
    for node in tree.body:  # module-level statements and what top-level if/try blocks hold, not functions
        stack = [node]
        while stack:
            stmt = stack.pop()
            if isinstance(stmt, ast.Import):
                top_level += [alias.name for alias in stmt.names]
            elif isinstance(stmt, ast.ImportFrom):
                top_level.append(stmt.module or "")
            elif isinstance(stmt, (ast.If, ast.Try, ast.With, ast.ExceptHandler)):
                stack += [s for field in ("body", "orelse", "finalbody", "handlers") for s in getattr(stmt, field, [])]
    assert top_level and all(name.split(".")[0] in sys.stdlib_module_names for name in top_level), top_level
    assert 'if __name__ == "__main__":' in vllm_baseline.WORKER.read_text()
