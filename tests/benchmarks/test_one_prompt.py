"""benchmarks.offline.one_prompt: ours for real on the benchmark checkpoint, vLLM's side through a fake worker that
answers like benchmarks/peers/vllm_one_prompt.py, and the flags."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from benchmarks.common.workloads import build_checkpoint
from benchmarks.offline import one_prompt
from benchmarks.peers.vllm_baseline import VllmSettings

# Prompt k of each length took (k + 1) * length microseconds; also echoes the environment it was given.
FAKE_WORKER = textwrap.dedent("""
    import json, os, sys
    job = json.load(open(sys.argv[1]))
    times = {n: [(k + 1) * int(n) * 1e-6 for k in range(len(group))] for n, group in job["prompts_by_length"].items()}
    json.dump({"vllm_version": "0.0-fake", "times_s": times,
               "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}}, open(sys.argv[2], "w"))
""")


def test_prompts_are_the_same_for_every_system_and_sized_as_asked():
    first, again = one_prompt.prompts_by_length([5, 30], repeats=3), one_prompt.prompts_by_length([5, 30], repeats=3)
    assert first == again
    assert {n: [len(p) for p in group] for n, group in first.items()} == {5: [5] * 5, 30: [30] * 5}
    assert first[5][0] != first[5][1]  # a fresh prompt each time: no prefix cache hit between them


def test_median_leaves_the_warm_up_prompts_out():
    assert one_prompt.median_ms([9.0, 9.0, 0.001, 0.002, 0.003]) == pytest.approx(2.0)


def test_ours_runs_and_writes_its_medians(tmp_path, capsys):
    out = tmp_path / "result.json"
    assert one_prompt.main(["--lens", "8", "40", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["system"] for r in result["runs"]] == ["ours"] and result["cpus"] == [0]
    medians = result["runs"][0]["median_ms"]
    assert set(medians) == {"8", "40"} and all(0 < ms < 10_000 for ms in medians.values())
    assert "40 tokens" in capsys.readouterr().out


def test_vllm_side_through_a_worker(tmp_path):
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    prompts = one_prompt.prompts_by_length([10, 100], repeats=3)
    settings = VllmSettings(python=sys.executable, threads_bind="0")
    medians = one_prompt.run_vllm(str(build_checkpoint()), prompts, settings, worker=worker)
    # timed prompts are k = 2, 3, 4 (two warm-ups first): median (3 + 1) * n us
    assert medians == {10: pytest.approx(0.04), 100: pytest.approx(0.4)}


def test_a_failing_worker_says_so(tmp_path):
    worker = tmp_path / "broken.py"
    worker.write_text("import sys; sys.stderr.write('no vllm here\\n'); sys.exit(3)")
    settings = VllmSettings(python=sys.executable)
    with pytest.raises(RuntimeError, match="(?s)exited with 3.*no vllm here"):
        one_prompt.run_vllm(str(build_checkpoint()), one_prompt.prompts_by_length([4], 1), settings, worker=worker)


@pytest.mark.parametrize("argv, message", [
    (["--lens", "4000"], "at most 2047 tokens"),
    (["--lens", "0"], "--lens"),
    (["--cpus", "zero"], "not a CPU list"),
    (["--threads", "2", "--cpus", "0"], "1 CPUs for 2 threads"),
    (["--cpus", "0-4095"], "may run on CPUs"),
])
def test_bad_flags_are_refused_with_the_flag_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        one_prompt.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
