"""``dtype="auto"``: which dtype an engine runs in, and that it says why at start."""

from __future__ import annotations

import logging

import pytest
import torch

from inflight.engine import device
from inflight.engine.device import resolve_dtype
from inflight.kernels import cpu_kernels
from tests.engine.helpers import make_engine

CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("dot_products", [True, False])
@pytest.mark.parametrize("hardware", ["amx_bf16", "avx512_bf16", None])
@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", "float32", None])
def test_auto_on_a_cpu_is_bfloat16_only_for_a_half_checkpoint_on_bfloat16_units(monkeypatch, hardware, checkpoint,
                                                                                 dot_products):
    monkeypatch.setattr(cpu_kernels, "bf16_hardware", lambda: hardware)
    monkeypatch.setattr(cpu_kernels, "bf16_dot_products", lambda: dot_products)
    half = checkpoint in ("bfloat16", "float16")
    want = torch.bfloat16 if half and hardware is not None and dot_products else torch.float32
    assert resolve_dtype("auto", checkpoint, CPU) == want


def test_an_explicit_dtype_is_kept_and_a_gpu_takes_the_checkpoints_half_precision(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "bf16_hardware", lambda: "avx512_bf16")
    assert resolve_dtype("float32", "bfloat16", CPU) == torch.float32
    assert resolve_dtype("bfloat16", "float32", CPU) == torch.bfloat16
    assert resolve_dtype("auto", "float16", GPU) == torch.float16
    assert resolve_dtype("auto", "float32", GPU) == torch.bfloat16


def test_the_hardware_is_read_from_the_cpus_flags(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_cpu_signature", lambda: "model name : X\nflags : fpu avx512f avx512_bf16 sse")
    assert cpu_kernels.bf16_hardware() == "avx512_bf16"
    monkeypatch.setattr(cpu_kernels, "_cpu_signature", lambda: "flags : avx512_bf16 amx_tile amx_bf16")
    assert cpu_kernels.bf16_hardware() == "amx_bf16"
    monkeypatch.setattr(cpu_kernels, "_cpu_signature", lambda: "flags : avx2 fma")
    assert cpu_kernels.bf16_hardware() is None


def test_the_reason_names_what_decided(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "bf16_hardware", lambda: "avx512_bf16")
    monkeypatch.setattr(cpu_kernels, "bf16_dot_products", lambda: True)
    dtype, why = device.choose_dtype("auto", "bfloat16", CPU)
    assert dtype == torch.bfloat16 and "avx512_bf16" in why and "bfloat16 checkpoint" in why
    monkeypatch.setattr(cpu_kernels, "bf16_dot_products", lambda: False)
    assert "built without" in device.choose_dtype("auto", "bfloat16", CPU)[1]
    monkeypatch.setattr(cpu_kernels, "bf16_hardware", lambda: None)
    assert device.choose_dtype("auto", "bfloat16", CPU) == (torch.float32, "auto: this CPU has no bfloat16 units")
    assert "float32 dtype" in device.choose_dtype("auto", "float32", CPU)[1]


def test_the_engine_logs_its_dtype_and_why(caplog):
    with caplog.at_level(logging.INFO, logger="inflight.engine.model_runner"):
        engine = make_engine(dtype="auto")
    assert engine.runner.dtype == torch.float32
    assert "running in float32 (auto" in caplog.text
