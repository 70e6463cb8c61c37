"""--model on the five benchmarks of issue 46: offline, serving, serve_vs_vllm, serving_overhead, scheduler. Each
parses it (the real model by default, its GGUF file, the random toy) and takes what it needs from it."""

from __future__ import annotations

import sys

import pytest
import yaml

from benchmarks.common.models import RANDOM
from benchmarks.common.workloads import MODEL_NAME
from benchmarks.micro import scheduler
from benchmarks.offline import offline
from benchmarks.peers import serve_vs_vllm
from benchmarks.serving import serving, serving_overhead
from inflight.engine.models.packaged import SMOLLM2, packaged_model_path
from inflight.serve_app.config import AppConfig


def gguf_path() -> str:
    try:
        return str(packaged_model_path(SMOLLM2))
    except ValueError as e:
        pytest.skip(str(e))


# (--model's value, or None for the default; the kind it resolves to; its token range)
def cases():
    return [pytest.param(None, "packaged", (17, 49152), id="default"),
            pytest.param(SMOLLM2, "packaged", (17, 49152), id="packaged"),
            pytest.param("GGUF", "gguf", (17, 49152), id="gguf"),
            pytest.param(RANDOM, "random", (4, 4096), id="random")]


def model_flag(name: str | None) -> list[str]:
    if name is None:
        gguf_path()  # the default needs the package
        return []
    return ["--model", gguf_path() if name == "GGUF" else name]


def in_range(ids, token_range) -> bool:
    return all(token_range[0] <= i < token_range[1] for i in ids)


@pytest.mark.parametrize("name, kind, token_range", cases())
def test_offline(name, kind, token_range):
    args, requests, _, _ = offline.parse_args([*model_flag(name), "--num-requests", "3", "--prompt-lens", "5", "9",
                                               "--output-lens", "2", "3"])
    assert args.bench_model.kind == kind and args.bench_model.token_range == token_range
    assert all(in_range(r.prompt_token_ids, token_range) and r.ignore_eos for r in requests)


def test_offline_chat_on_the_real_model_and_its_refusals(capsys):
    flag = model_flag(SMOLLM2)
    args, requests, _, name = offline.parse_args([*flag, "--workload", "chat", "--num-requests", "3"])
    assert name == "chat" and all(not r.ignore_eos for r in requests)
    for argv, message in ((["--model", RANDOM, "--workload", "chat"], "bench-random has no chat template"),
                          ([*flag, "--workload", "chat", "--baselines", "hf"], "transformers' baselines run every"),
                          (["--model", "demo-tiny", "--baselines", "vllm", "--vllm-python", sys.executable],
                           "no checkpoint for vllm"),
                          (["--model", "llama-9000"], "--model: 'llama-9000' is not a model")):
        with pytest.raises(SystemExit):
            offline.parse_args(argv)
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("name, kind, token_range", cases())
def test_serving(name, kind, token_range):
    args = serving.parse_args([*model_flag(name), "--num-requests", "4", "--prompt-lens", "5", "9"])
    known = serving.known_model(args.model)
    if name is None:  # no --model: the name comes from the server's /v1/models
        assert args.model is None and known is None
        return
    assert known.kind == kind
    requests = serving.build_requests(args, known)
    assert len(requests) == 4 and all(in_range(r.prompt_token_ids, token_range) and r.ignore_eos for r in requests)
    assert known.served_name == {SMOLLM2: SMOLLM2, RANDOM: MODEL_NAME}.get(name, gguf_path())


def test_serving_chat_and_names_it_does_not_know(capsys):
    args = serving.parse_args([*model_flag(SMOLLM2), "--workload", "chat", "--num-requests", "3"])
    requests = serving.build_requests(args, serving.known_model(args.model))
    assert all(not r.ignore_eos and r.prompt_token_ids[0] == 1 for r in requests)  # <|im_start|>
    # any other served name: prompts of --vocab-range, by default demo-tiny's ids; no chat
    args = serving.parse_args(["--model", "my-model", "--num-requests", "3", "--prompt-lens", "4", "6"])
    assert serving.known_model("my-model") is None
    assert all(in_range(r.prompt_token_ids, serving.DEMO_TINY_VOCAB) for r in serving.build_requests(args, None))
    args = serving.parse_args(["--model", "my-model", "--workload", "chat"])
    with pytest.raises(ValueError, match="chat template is unknown"):
        serving.build_requests(args, None)
    with pytest.raises(SystemExit):  # a path is a model or a mistake, never a served name
        serving.parse_args(["--model", "/no/such/model.gguf"])
    assert "--model: '/no/such/model.gguf'" in capsys.readouterr().err


@pytest.mark.parametrize("name, kind, token_range", cases())
def test_serve_vs_vllm(name, kind, token_range, tmp_path):
    _, args = serve_vs_vllm.parse_args([*model_flag(name), "--systems", "ours,vllm"])
    model = args.bench_model
    assert model.kind == kind and args.systems == ["ours", "vllm"]
    config = yaml.safe_load(serve_vs_vllm.bench_config(model.engine_model, None, model.served_name))
    app = AppConfig.model_validate(config["applications"][0]["args"])
    assert (app.model, app.model_name) == (model.engine_model, model.served_name)
    if kind == "random":  # (the others' export is made and checked in test_models)
        hf = str(model.hf_dir())
        server = serve_vs_vllm.vllm_server_argv("py", "auto", False, model, "bfloat16")
        assert server[server.index("--model") + 1] == hf and server[server.index("--dtype") + 1] == "bfloat16"
        assert server[server.index("--served-model-name") + 1] == MODEL_NAME == app.model_name
        client = serve_vs_vllm.client_argv("py", 8001, model, 4, 4, 0, tmp_path / "out.json")
        assert client[client.index("--model") + 1] == hf and MODEL_NAME in client


@pytest.mark.parametrize("name, kind, token_range", cases())
def test_serving_overhead(name, kind, token_range):
    args = serving_overhead.parse_args([*model_flag(name), "--streams", "2"])
    assert args.bench_model.kind == kind
    prompts = serving_overhead.prompts(5, 64, args.bench_model.token_range)
    assert len({tuple(p) for p in prompts}) == 5 and all(in_range(p, token_range) for p in prompts)
    assert serving_overhead.prompts(2, 4) == [[7, 14, 21, 28], [38, 45, 52, 59]]  # demo-tiny's, as before


@pytest.mark.parametrize("name, kind, token_range", cases())
def test_scheduler(name, kind, token_range):
    args = scheduler.parse_args([*model_flag(name), "--num-requests", "4"])
    assert args.bench_model.kind == kind
    token = args.stand_in_token_id  # an ordinary token that becomes printable text
    assert token_range[0] <= token < token_range[1]
    assert args.bench_model.tokenizer.decode([token]).isprintable()


def test_scheduler_stand_in_is_a_letter_as_demo_tinys_was():
    for name in ("demo-tiny", *model_flag(SMOLLM2)[1:]):
        args = scheduler.parse_args(["--model", name])
        assert args.bench_model.tokenizer.decode([args.stand_in_token_id]) == "a"  # (demo-tiny's used to be "b")


@pytest.mark.parametrize("module", [offline, serving, serve_vs_vllm, serving_overhead, scheduler])
def test_help_names_the_flag(module, capsys):
    parse = module.parse_args
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = capsys.readouterr().out
    assert "--model" in out and RANDOM in out  # the flag and its choices are documented


def test_online_latency_and_sweep_take_the_flag_and_keep_the_toy_default():
    from benchmarks.offline import online_latency, sweep

    args, _ = online_latency.parse_args(["--num-requests", "2"])
    assert args.bench_model.kind == "random" and sweep.parse_args([]).bench_model.kind == "random"
    args, requests = online_latency.parse_args([*model_flag(SMOLLM2), "--workload", "chat", "--num-requests", "2"])
    assert args.bench_model.kind == "packaged" and not any(r.ignore_eos for r in requests)
    assert sweep.parse_args([*model_flag("GGUF")]).bench_model.kind == "gguf"
