"""A bfloat16 decode step's layers in one call of the CPU kernels (engine/models/cpu_decode.py): the same bits as
the layers run one by one from Python, and taken only where the layers are exactly those kernels."""

from __future__ import annotations

import pytest
import torch

from inflight.engine.models import cpu_decode
from inflight.kernels import cpu_kernels
from tests.engine.helpers import greedy, make_engine, random_prompts

pytestmark = pytest.mark.skipif(not cpu_kernels.bf16_dot_products(),
                                reason="the kernels' build here has no AVX-512 BF16 dot products")


def _run(path, fused: bool, monkeypatch, threads: int) -> tuple[list, int]:
    calls = []
    original = cpu_kernels.decode_layers

    def counted(*args, **kwargs):
        calls.append(args[2].shape[0])  # the step's rows
        return original(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "decode_layers", counted)
    engine = make_engine(path, dtype="bfloat16", max_num_seqs=24, max_num_batched_tokens=256, num_threads=threads)
    if not fused:
        engine.runner.model.fused_decode = None
    # 20 prompts at once: decode steps of 20 rows down to 1 (rows in groups of 8, chunked and not)
    prompts = random_prompts(20, 3, 40, seed=7)
    params = [greedy(4 + i % 9, logprobs=2) for i in range(len(prompts))]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    results = [(finished[f"r{i}"].token_ids, [(lp.keys(), [v.logprob for v in lp.values()])
                                              for lp in finished[f"r{i}"].logprobs]) for i in range(len(prompts))]
    return results, calls


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {"hidden_size": 128}),  # heads of 32: attention on dot products
    ("mistral", {"sliding_window": None}),  # heads of 16: the kernels' widening path (no window: not its kernels')
    ("qwen2", {"hidden_size": 128, "use_sliding_window": False}),  # a qkv bias
])
def test_fused_decode_gives_the_layer_by_layer_bits(checkpoint, monkeypatch, arch, overrides):
    _same_bits_fused_and_layered(checkpoint(arch, dtype=torch.bfloat16, **overrides), monkeypatch)


@pytest.mark.parametrize("arch, tensor_type", [("llama", "Q4_1"), ("llama", "Q8_0"), ("qwen2", "Q4_0")])
def test_fused_decode_on_weights_kept_quantized_gives_the_layer_by_layer_bits(tmp_path, monkeypatch, arch,
                                                                             tensor_type):
    from inflight.engine.models.quantized import QuantLinear
    from tests.gguf_files import write_gguf

    monkeypatch.setenv("INFLIGHT_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "model.gguf", arch, tensor_type, hidden_size=128)
    assert isinstance(make_engine(path, dtype="bfloat16").runner.model.model.layers[0].mlp.down_proj, QuantLinear)
    _same_bits_fused_and_layered(path, monkeypatch)


def _same_bits_fused_and_layered(path, monkeypatch):
    for threads in (1, 2):
        fused, calls = _run(path, True, monkeypatch, threads)
        layered, no_calls = _run(path, False, monkeypatch, threads)
        assert max(calls) >= 17 and min(calls) == 1 and no_calls == []
        assert fused == layered


def test_only_bfloat16_cpu_models_without_qk_norms_get_it(checkpoint):
    def fused_decode(path, dtype):
        return make_engine(path, dtype=dtype).runner.model.fused_decode

    llama = checkpoint("llama", dtype=torch.bfloat16)
    assert isinstance(fused_decode(llama, "bfloat16"), cpu_decode.FusedDecode)
    assert fused_decode(llama, "float32") is None
    assert fused_decode(checkpoint("qwen3", dtype=torch.bfloat16), "bfloat16") is None  # q/k norms
    assert fused_decode(checkpoint("mistral", dtype=torch.bfloat16), "bfloat16") is None  # sliding windows
    assert fused_decode(checkpoint("gemma2", dtype=torch.bfloat16, sliding_window=None,
                                   attn_logit_softcapping=None), "bfloat16") is None  # Gemma's layers
