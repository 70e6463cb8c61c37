"""What speculative decoding buys: ``python -m benchmarks.offline.offline --speculative none,ngram,oracle``.

Each method is a continuous-batching run of the same workload with ``speculative_config={"method": ...}`` (none:
no speculation), greedy, so every run emits the very same tokens and differs only in how many steps that takes
and what each costs. ``oracle`` proposes what a plain run of the same requests produced (computed first, not
timed): every proposal is accepted, the mechanism's ceiling. Reported per method: tok/s against none, proposed
and accepted tokens, the acceptance rate and tokens per verifying step.

``draft`` proposes with a layer-skip draft of the benchmark checkpoint: the same weights with only its first
``DRAFT_LAYERS`` decoder layers (``build_draft_checkpoint``; written once next to the checkpoint), so it shares the
embeddings, the final norm and the head, costs a fraction of a target step and agrees with the target where the
later layers change little.

``--workload copy`` is the copy-heavy case n-gram lookup is for: each prompt is a random prompt followed by the
first ``COPY_PREFIX`` tokens of the benchmark checkpoint's own greedy continuation of it (a random model's greedy
output falls into loops), so the output goes on repeating spans that are already in the prompt.

    python -m benchmarks.offline.offline --workload copy --max-num-seqs 1 --num-requests 16 --speculative none,ngram,oracle
    python -m benchmarks.offline.offline --workload seed --speculative none,ngram --repeats 3
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Sequence

from benchmarks.common.engine import drain, make_engine
from benchmarks.common.workloads import BenchRequest, sampling_params

METHODS = ("none", "ngram", "draft", "oracle")
COPY_PREFIX = 120  # tokens of the model's own continuation appended to each copy-workload prompt
DRAFT_LAYERS = 1  # decoder layers the layer-skip draft keeps


def system_name(method: str) -> str:
    return "continuous" if method == "none" else f"spec-{method}"


def method_of(system: str) -> str | None:
    return system.removeprefix("spec-") if system.startswith("spec-") else None


def speculative_config(method: str, oracle_outputs: dict | None, model_path: str) -> dict[str, Any]:
    config: dict[str, Any] = {"method": method}
    if method == "oracle":
        config["oracle_outputs"] = oracle_outputs
    if method == "draft":
        config["draft_model"] = str(build_draft_checkpoint(model_path))
    return config


def build_draft_checkpoint(model_path: str, num_layers: int = DRAFT_LAYERS) -> Path:
    """A copy of the checkpoint at ``model_path`` with only its first ``num_layers`` decoder layers (same
    tokenizer, embeddings, final norm and head): a draft that costs a fraction of a target step. Written once."""
    from safetensors.torch import load_file, save_file

    source = Path(model_path)
    target = source.with_name(f"{source.name}-draft-l{num_layers}")
    if (target / "model.safetensors").exists():
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, staging / name)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    kept = {name: tensor for name, tensor in load_file(source / "model.safetensors").items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    save_file(kept, staging / "model.safetensors", metadata={"format": "pt"})
    staging.rename(target)
    return target


def greedy_outputs(model_path: str, requests: Sequence[BenchRequest], args) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Each request's greedy output, by prompt, from a plain engine (what the oracle proposes)."""
    engine = make_engine(model_path, "continuous", args)
    for i, request in enumerate(requests):
        engine.add_request(str(i), request.prompt_token_ids, sampling_params(request.max_tokens))
    outputs = {int(o.request_id): o.outputs[0].token_ids for o in drain(engine)}
    return {tuple(r.prompt_token_ids): tuple(outputs[i]) for i, r in enumerate(requests)}


def copy_heavy(requests: Sequence[BenchRequest], model_path: str, args) -> list[BenchRequest]:
    """``requests`` with each prompt extended by the model's own greedy continuation of it (``COPY_PREFIX``
    tokens): what follows repeats what the prompt already holds."""
    lead = [BenchRequest(r.prompt_token_ids, COPY_PREFIX) for r in requests]
    continued = greedy_outputs(model_path, lead, args)
    return [BenchRequest([*r.prompt_token_ids, *continued[tuple(r.prompt_token_ids)]], r.max_tokens)
            for r in requests]


def summary(stats: dict[str, Any]) -> dict[str, Any]:
    """The engine's speculation counters: ``stats()``'s spec_* entries."""
    return {k: v for k, v in stats.items() if k.startswith("spec_")}


def report_rows(results: dict[str, Any]) -> list[list[Any]]:
    """One row per method: tok/s, against none, proposed, accepted, acceptance rate, verifying steps."""
    base = results.get("continuous")
    rows = []
    for system, result in results.items():
        method = method_of(system) or ("none" if system == "continuous" else None)
        if method is None:
            continue
        extra = result.extra
        rate = extra.get("spec_acceptance_rate")
        rows.append([method, result.tokens_per_s,
                     f"{result.tokens_per_s / base.tokens_per_s:.2f}" if base is not None else "-",
                     extra.get("spec_num_proposed_tokens", 0), extra.get("spec_num_accepted_tokens", 0),
                     f"{rate:.0%}" if rate is not None else "-", extra.get("spec_num_steps", 0)])
    return rows
