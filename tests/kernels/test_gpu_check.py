"""benchmarks/micro/gpu_check.sh without a GPU stops at once with a clear message; its roofline counts the right bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.micro.gpu_check import LLAMA3_8B, roofline

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="about machines without CUDA")
def test_gpu_check_fails_fast_and_clearly_without_cuda(tmp_path):
    # PYTHON: this interpreter, also where the checkout has no .venv of its own (a git worktree)
    env = {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHON": sys.executable}
    proc = subprocess.run([str(ROOT / "benchmarks" / "micro" / "gpu_check.sh"), "--quick"], capture_output=True,
                          text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_roofline_counts_llama3_8b_weights_and_kv():
    bound = roofline(batch=64, context=2048, num_layers=32, read_bw=4e12)
    # Llama-3-8B has 8.03 B parameters: 16.06 GB in bf16, all read once per decode step.
    assert bound["weight_bytes"] == pytest.approx(2 * 8.03e9, rel=0.005)
    # K and V, 32 layers, 8 heads x 128 dims, 2 bytes: 128 KiB per token; 64 x 2,048 tokens.
    assert bound["kv_bytes_per_step"] == 64 * 2048 * 32 * 2 * 8 * 128 * 2
    assert bound["roofline_tokens_per_s"] == pytest.approx(64 / ((bound["weight_bytes"] + bound["kv_bytes_per_step"]) / 4e12))
    assert LLAMA3_8B["num_key_value_heads"] * LLAMA3_8B["head_dim"] == 1024
