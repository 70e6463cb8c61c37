"""benchmarks.common.models: --model resolved for every kind of name, and a GGUF file's Hugging Face export."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from benchmarks.common import models
from benchmarks.common.models import BenchModel, export_dir, export_hf_checkpoint, resolve_model
from benchmarks.common.workloads import FIRST_WORD_ID, MODEL_NAME, VOCAB_SIZE, build_checkpoint
from inflight.engine.models.packaged import DEFAULT_MODEL, SMOLLM2, packaged_model_path
from tests.gguf_files import write_gguf


def real_gguf():
    """The packaged model's file, or a skip where the package is not installed (`make install` goes on without
    it when it cannot be fetched)."""
    try:
        return packaged_model_path(SMOLLM2)
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A random two-layer Llama with tied embeddings as a Q8_0 GGUF file (demo-tiny's byte vocabulary and chat
    template; its transformers checkpoint beside it, in ../hf)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(path, "llama", "Q8_0", tie_word_embeddings=True)


# -- each kind of name ---------------------------------------------------------------------------------------
def test_the_default_is_the_packaged_real_model_with_its_ordinary_tokens():
    real_gguf()
    model = resolve_model()
    assert (model.name, model.kind, model.engine_model, model.served_name) == (DEFAULT_MODEL, "packaged", SMOLLM2,
                                                                               SMOLLM2)
    # SmolLM2's 17 added tokens (<|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...) are ids 0-16
    assert model.token_range == (17, 49152) and model.max_position_embeddings == 8192
    assert model.eos_token_ids == {2} and model.gguf_file == packaged_model_path(SMOLLM2)
    token = model.printable_token_id()
    assert 17 <= token < 49152 and model.tokenizer.decode([token]).isalpha()


def test_a_gguf_path_is_the_same_model_served_under_its_path():
    path = real_gguf()
    model = resolve_model(str(path))
    assert (model.kind, model.engine_model, model.served_name) == ("gguf", str(path), str(path))
    assert model.token_range == resolve_model(SMOLLM2).token_range
    # the packaged name and its file share one export
    assert export_dir(model.gguf_file, model.cache_dir) == export_dir(resolve_model(SMOLLM2).gguf_file,
                                                                       model.cache_dir)


def test_bench_random_is_the_toy_checkpoint_under_its_old_served_name(tmp_path):
    model = resolve_model(models.RANDOM)
    assert model.kind == "random" and model.engine_model == str(build_checkpoint())
    assert model.served_name == MODEL_NAME and model.token_range == (FIRST_WORD_ID, VOCAB_SIZE)
    assert model.hf_dir() == build_checkpoint()  # the peers load it as it is
    assert resolve_model(MODEL_NAME).engine_model == model.engine_model  # by its served name too


def test_demo_tiny_has_its_byte_ids_and_no_checkpoint_for_the_peers():
    model = resolve_model("demo-tiny")
    assert model.kind == "builtin" and model.token_range == (7, 263)
    with pytest.raises(ValueError, match="--model demo-tiny: the built-in model has no checkpoint"):
        model.hf_dir()


def test_a_checkpoint_directory_is_loaded_as_it_is(tiny_gguf):
    hf = tiny_gguf.parent / "hf"
    model = resolve_model(str(hf))
    assert (model.kind, model.engine_model, model.served_name) == ("hf", str(hf), str(hf))
    assert model.hf_dir() == hf and model.token_range == (7, 263)


@pytest.mark.parametrize("name", ["no-such-model", "/nowhere/model.gguf", "/tmp"])
def test_a_bad_name_is_an_error_naming_the_flag(name):
    with pytest.raises(ValueError, match=r"^--model.*(not a model the benchmarks know|config\.json)"):
        resolve_model(name)


def test_a_file_that_is_no_gguf_is_an_error_naming_the_flag(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope" * 10)
    with pytest.raises(ValueError, match=r"^--model .*bad\.gguf.*not a GGUF file"):
        resolve_model(str(bad))


def test_the_shared_flag_defaults_to_the_real_model_and_fails_through_the_parser(capsys):
    parser = argparse.ArgumentParser(prog="bench")
    models.add_model_arg(parser)
    assert parser.parse_args([]).model is None  # resolved as DEFAULT_MODEL
    assert DEFAULT_MODEL in parser.format_help() and models.RANDOM in parser.format_help()
    with pytest.raises(SystemExit):
        models.model_from_args(parser, parser.parse_args(["--model", "gpt-17"]))
    assert "--model: 'gpt-17' is not a model the benchmarks know" in capsys.readouterr().err


# -- the export ------------------------------------------------------------------------------------------------
def test_the_export_is_a_checkpoint_our_engine_and_transformers_read_as_the_gguf(tiny_gguf, tmp_path):
    import torch
    import transformers
    from safetensors.torch import load_file

    from inflight.engine import LLM, SamplingParams
    from inflight.engine.models.gguf_checkpoint import cached_description, read_gguf_tensors
    from inflight.engine.models.source import read_model_source

    # a stale half-written export and a directory without its .complete marker are never used
    target = export_dir(tiny_gguf, tmp_path)
    (tmp_path / f".{target.name}-stale").mkdir(parents=True)
    target.mkdir()
    (target / "config.json").write_text("{}")
    path = export_hf_checkpoint(tiny_gguf, tmp_path)
    assert path == target and (path / ".complete").exists()
    assert sorted(os.listdir(path)) == [".complete", "config.json", "generation_config.json", "model.safetensors",
                                        "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((path / "config.json").read_text()) != {}  # the incomplete one was replaced
    # the weights: the file's dequantized float32 values, and no lm_head with tied embeddings
    source = read_model_source(str(tiny_gguf))
    weights = load_file(str(path / "model.safetensors"))
    expected = dict(read_gguf_tensors(tiny_gguf, source.config))
    assert set(weights) == set(expected) and "lm_head.weight" not in weights
    assert all(weights[k].dtype == torch.float32 and torch.equal(weights[k], expected[k]) for k in expected)
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["torch_dtype"], config["tie_word_embeddings"]) == ("llama", "float32", True)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2
    # the tokenizer and chat template round-trip
    exported = read_model_source(str(path))
    messages = [{"role": "user", "content": "Summarize this: batching, paged KV."}]
    assert exported.tokenizer.chat_prompt(messages) == source.tokenizer.chat_prompt(messages)
    assert exported.eos_token_ids == source.eos_token_ids
    assert (path / "tokenizer.json").read_text() == cached_description(tiny_gguf)["tokenizer_json"]
    # the same greedy tokens from our engine on either, and from transformers on the export (what the peers load)
    prompt = source.tokenizer.chat_prompt(messages)["prompt_token_ids"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # (the GGUF file dequantized: the model the export holds)
    ours = [LLM(m, device="cpu", dtype="float32", quantization="none").generate([prompt], params)[0]
            .outputs[0].token_ids for m in (str(tiny_gguf), str(path))]
    assert ours[0] == ours[1] and len(ours[0]) == 12
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == ours[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)  # vllm bench serve's and vLLM's tokenizer
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"] == prompt
    assert export_hf_checkpoint(tiny_gguf, tmp_path) == path  # made once


@pytest.mark.slow
def test_the_real_models_export_gives_the_same_greedy_tokens_as_the_gguf():
    """SmolLM2 exported into the benchmark cache (once: ~540 MB, float32), loaded by our engine: the same greedy
    tokens as the GGUF file for a short chat prompt."""
    from inflight.engine import LLM, SamplingParams

    real_gguf()
    model = resolve_model(SMOLLM2)
    path = model.hf_dir()
    assert path.parent == model.cache_dir and (path / ".complete").exists()
    exported = resolve_model(str(path))
    assert exported.kind == "hf" and exported.token_range == model.token_range
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = model.tokenizer.chat_prompt(messages)["prompt_token_ids"]
    assert exported.tokenizer.chat_prompt(messages)["prompt_token_ids"] == prompt
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = [LLM(m, device="cpu", dtype="float32", quantization="none", max_model_len=256, num_kv_blocks=32)
               .generate([prompt], params)[0].outputs[0].token_ids for m in (model.engine_model, str(path))]
    assert outputs[0] == outputs[1] and len(outputs[0]) >= 4


def test_hf_files_name_the_model_type_and_float32():
    description = {"hf_config": {"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 4096},
                   "eos_token_ids": [5, 7], "bos_token": None, "eos_token": "<e>", "chat_template": None,
                   "tokenizer_json": _tokenizer_json()}
    files = models.hf_files(description)
    assert files["config.json"]["model_type"] == "qwen2" and files["config.json"]["dtype"] == "float32"
    assert files["config.json"]["eos_token_id"] == [5, 7] and files["generation_config.json"] == {"eos_token_id": [5, 7]}
    assert files["tokenizer_config.json"] == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<e>",
                                              "pad_token": "<e>", "model_max_length": 4096,
                                              "clean_up_tokenization_spaces": False}


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models as tmodels

    return Tokenizer(tmodels.WordLevel({"<e>": 0, "a": 1}, unk_token="<e>")).to_str()


def test_a_bench_model_describes_itself_for_the_reports():
    model = BenchModel("x", "hf", "/m", "/m", (3, 10), 512, Path("/c"))
    assert model.describe() == {"name": "x", "kind": "hf", "engine_model": "/m", "served_name": "/m",
                                "token_range": [3, 10]}
