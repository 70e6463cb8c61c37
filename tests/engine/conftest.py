"""The real model's engines that several engine tests read the same way, each built once for tests/engine.

Building ``LLM(SMOLLM2, ...)`` takes 5-15 s here (reading the GGUF file's metadata, dequantizing, a 1 GiB KV pool);
tests that only generate from it, and need no fresh engine (none of them reads its stats or relies on an empty
prefix cache), share these. A test that checks a fresh engine's state builds its own."""

from __future__ import annotations

import pytest


def _smollm2(dtype: str):
    from inflight.engine import LLM
    from inflight.engine.models.packaged import SMOLLM2

    return LLM(SMOLLM2, device="cpu", dtype=dtype, quantization="none")


@pytest.fixture(scope="package")
def smollm2():
    """The real model dequantized in float32: transformers' model of the file (tests/engine/test_gguf.py)."""
    return _smollm2("float32")


@pytest.fixture(scope="package")
def smollm2_bfloat16():
    """The real model dequantized in bfloat16."""
    return _smollm2("bfloat16")
