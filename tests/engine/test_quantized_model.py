"""GGUF weights kept quantized (``quantization="auto"``): read exactly, placed as quantized modules, and a model that
stays the file's model (close to the dequantized one, exact for a row whatever its batch).

The dequantized model (``quantization="none"``) is the reference: transformers loads that one
(tests/engine/test_gguf.py). Kept quantized, the activations are rounded to int8 per block of 32, so logits move by a
little and greedy tokens may part from the dequantized model's only where two candidates nearly tie."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflight.engine import LLM, SamplingParams
from inflight.engine.config import EngineConfig
from inflight.engine.models import gguf_quant
from inflight.engine.models.packaged import SMOLLM2
from inflight.engine.models.quantized import QuantEmbedding, QuantLinear, weight_bytes
from inflight.kernels import cpu_kernels
from tests.gguf_files import write_gguf

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels did not build here")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_CACHE", str(tmp_path / "cache"))


def random_blocks(gguf_type: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes in ``gguf_type``'s blocks, with finite fp16 scales (and minimums) where the format has them."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    block, size = quants.GGML_QUANT_SIZES[GGMLQuantizationType[gguf_type]]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    halves = 2 if gguf_type in ("Q4_1", "Q4_K") else 1
    scales = rng.uniform(-0.05, 0.05, (n, k // block, halves)).astype(np.float16)
    raw[..., :2 * halves] = scales.view(np.uint8).reshape(n, k // block, 2 * halves)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("gguf_type", sorted(gguf_quant.KEPT_TYPES))
def test_each_kept_type_reads_as_ggufs_own_dequantization(gguf_type):
    from gguf import GGMLQuantizationType, quants

    n, k = 40, 512
    raw = random_blocks(gguf_type, n, k)
    values = gguf_quant.read(raw, gguf_type, (n, k))
    assert values.format == gguf_quant.KEPT_TYPES[gguf_type] and values.shape == (n, k)
    want = quants.dequantize(raw, GGMLQuantizationType[gguf_type]).reshape(n, k)
    assert np.array_equal(values.dequantize().numpy(), want)


def test_another_type_is_not_read_as_kept():
    with pytest.raises(ValueError, match="Q6_K is not kept quantized"):
        gguf_quant.read(np.zeros((1, 210), np.uint8), "Q6_K", (1, 256))


def quantized_modules(llm: LLM) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in llm.engine.runner.model.named_modules()
            if isinstance(m, (QuantLinear, QuantEmbedding))}


def prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    return [lp[token].logprob for token, lp in zip(ids[1:], out.prompt_logprobs[1:])]


@pytest.mark.parametrize("arch,tensor_type,dtype", [
    ("llama", "Q4_1", "float32"), ("llama", "Q8_0", "bfloat16"), ("qwen2", "Q4_0", "float32"),  # qwen2: qkv bias, tied
])
def test_kept_quantized_the_model_scores_text_as_the_dequantized_one(tmp_path, arch, tensor_type, dtype):
    path = write_gguf(tmp_path / "model.gguf", arch, tensor_type)
    kept = LLM(str(path), device="cpu", dtype=dtype)
    exact = LLM(str(path), device="cpu", dtype=dtype, quantization="none")
    modules = quantized_modules(kept)
    assert modules["model.embed_tokens"] == "QuantEmbedding" and modules["lm_head"] == "QuantLinear"
    assert modules["model.layers.1.self_attn.qkv_proj"] == "QuantLinear" and len(modules) == 2 + 4 * 2
    assert quantized_modules(exact) == {}
    # (q8 against bfloat16: 10 bits a weight against 16; q4 against float32: 6 against 32)
    assert weight_bytes(kept.engine.runner.model) < weight_bytes(exact.engine.runner.model) * 0.7
    ids = kept.tokenizer.encode("The quick brown fox jumps over the lazy dog, again and again and again.")
    got, want = np.array(prompt_logprobs(kept, ids)), np.array(prompt_logprobs(exact, ids))
    # (these random models' logprobs are -5 to -12; a wrong weight, or Q/K rotated wrong, moves them by units)
    size = np.abs(want).mean()
    assert np.abs(got - want).mean() < 0.01 * size and np.abs(got - want).max() < 0.05 * size


def test_a_fused_linear_whose_parts_differ_is_dequantized_and_the_rest_kept(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", "llama", "Q4_1", tensor_types={"v_proj": "Q8_0", "up_proj": "Q5_0"})
    modules = quantized_modules(LLM(str(path), device="cpu", dtype="float32"))
    assert "model.layers.0.self_attn.o_proj" in modules and "model.layers.0.mlp.down_proj" in modules
    assert "model.layers.0.self_attn.qkv_proj" not in modules  # q/k in q4, v in q8: one fused linear, one layout
    assert "model.layers.0.mlp.gate_up_proj" not in modules  # up in Q5_0, not kept


def test_a_requests_tokens_do_not_depend_on_the_requests_beside_it(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", "llama", "Q4_1", hidden_size=128)
    llm = LLM(str(path), device="cpu", dtype="bfloat16", max_num_seqs=8)
    prompts = [llm.tokenizer.encode(text) for text in ("Hello there", "The quick brown fox", "1, 2, 3,",
                                                       "A longer prompt that fills a chunk of its own")]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    alone = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_quantization_none_or_a_gpu_dequantizes_and_a_bad_value_is_named(tmp_path):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig.from_kwargs(quantization="int3")
    from inflight.engine.models.loader import keeps_quantized

    assert keeps_quantized("auto", torch.device("cpu")) and not keeps_quantized("none", torch.device("cpu"))
    assert not keeps_quantized("auto", torch.device("meta"))


@pytest.mark.slow
def test_the_real_models_perplexity_kept_quantized_is_within_one_percent(smollm2_bfloat16):
    from benchmarks.offline.perplexity import corpus_text, perplexity, windows

    results = {}
    for quantization in ("none", "auto"):  # (none: tests/engine/conftest.py's, shared with test_gguf.py)
        llm = smollm2_bfloat16 if quantization == "none" else LLM(SMOLLM2, device="cpu", dtype="bfloat16",
                                                                  quantization=quantization)
        results[quantization] = perplexity(llm, windows(llm.tokenizer.encode(corpus_text()), 512, 2))
    assert abs(results["auto"] / results["none"] - 1) < 0.01, results


@pytest.mark.slow
def test_the_real_model_kept_quantized_parts_from_the_dequantized_one_only_at_near_ties(smollm2):
    """Greedy chat answers of the Q4_1 file kept quantized against the same file dequantized (both float32): where
    they part, the dequantized model scores the two candidates within 0.5 of each other."""
    from tests.engine.test_gguf import CHAT_QUESTIONS

    kept = LLM(SMOLLM2, device="cpu", dtype="float32")
    exact = smollm2  # (quantization="none": tests/engine/conftest.py's, shared with test_gguf.py)
    assert quantized_modules(kept) and not quantized_modules(exact)
    params = SamplingParams(max_tokens=32, temperature=0)
    identical = 0
    prompts = [kept.tokenizer.chat_prompt([{"role": "user", "content": q}])["prompt_token_ids"] for q in CHAT_QUESTIONS]
    batch = [{"prompt_token_ids": ids} for ids in prompts]  # (each model's answers in one batch)
    answers = zip(kept.generate(batch, params), exact.generate(batch, params))
    for question, ids, (kept_answer, exact_answer) in zip(CHAT_QUESTIONS, prompts, answers):
        got, want = list(kept_answer.outputs[0].token_ids), list(exact_answer.outputs[0].token_ids)
        if got == want:
            identical += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        scores = exact.generate({"prompt_token_ids": ids + want[:at]},
                                SamplingParams(max_tokens=1, temperature=0, logprobs=20))[0].outputs[0].logprobs[0]
        assert got[at] in scores, (question, at)  # the kept model's choice is among the exact model's top 20
        gap = scores[want[at]].logprob - scores[got[at]].logprob
        assert gap < 0.5, (question, at, gap)
    # (2026-12-07: 3 of 12 identical to their 32 tokens; llama.cpp's server, on the same file with the same int8
    # activations, parts from the dequantized model at the same first near-tie: "L'Étoile" for France's capital)
    assert identical >= 1, "no answer identical"


def test_fp8_weights_give_the_model_of_their_dequantized_values(checkpoint, tmp_path):
    """``quantization="fp8"``: the layers' linears in float8 e4m3 through the Triton kernel (here under Triton's
    interpreter, which tests/conftest.py turns on). The reference is the same checkpoint with each layer weight
    replaced by its e4m3 value times its row's scale, run dequantized: the same numbers up to float32 sums."""
    import shutil

    from safetensors.torch import load_file, save_file

    from inflight.engine.models.quantized import Fp8Linear
    from inflight.kernels import triton_fp8

    path = checkpoint("qwen2")  # (a qkv bias, tied embeddings)
    reference_dir = tmp_path / "fp8-values"
    shutil.copytree(path, reference_dir)
    weights = load_file(str(path / "model.safetensors"))
    for name, tensor in weights.items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            weights[name] = triton_fp8.dequantize(*triton_fp8.quantize(tensor)).to(tensor.dtype)
    save_file(weights, str(reference_dir / "model.safetensors"))
    fp8 = LLM(str(path), device="cpu", dtype="float32", quantization="fp8")
    reference = LLM(str(reference_dir), device="cpu", dtype="float32")
    model = fp8.engine.runner.model
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 4 * 2
    assert not isinstance(model.lm_head, Fp8Linear)
    ids = fp8.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    got, want = np.array(prompt_logprobs(fp8, ids)), np.array(prompt_logprobs(reference, ids))
    assert np.abs(got - want).max() < 1e-3


def test_fp8_on_a_cpu_is_refused_naming_quantization(checkpoint, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="quantization: 'fp8' needs a CUDA GPU"):
        LLM(str(checkpoint("llama")), device="cpu", dtype="float32", quantization="fp8")
