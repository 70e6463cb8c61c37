"""transformers on the same model and workload, as baselines: static ``generate`` and continuous batching.

* ``hf-static``: ``model.generate``, left padding, batches of ``--static-batch-size`` in arrival order,
  ``max_new_tokens`` = the longest request of the batch (every row runs that long);
* ``hf-cb``: transformers' continuous batching manager (``model.init_continuous_batching``), one
  ``add_request`` per request with its own ``max_new_tokens``, the same KV budget as ours in pages of 16.

Both get every request at t=0, are warmed up with a couple of tiny requests, and time from the first
submission to each completion with ``time.perf_counter``.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from benchmarks.common.metrics import padded_static_batch_tokens
from benchmarks.common.workloads import BLOCK_SIZE, PAD_ID, TOY_TOKEN_RANGE, BenchRequest, kv_blocks, warmup_workload

BASELINES = ("hf-static", "hf-cb")


@dataclass
class BaselineRun:
    system: str
    span_s: float
    latencies_s: list[float]  # per request, in workload order, from t=0
    computed_tokens: int | None  # None: the system does not say
    extra: dict[str, Any] = field(default_factory=dict)
    output_tokens: list[int] | None = None  # per request; None: exactly each one's max_tokens


def quiet_transformers() -> None:
    """transformers' warnings are noise here; so is the CB manager's psutil notice (CPU memory sizing only
    matters when num_blocks is not given, and we give it)."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("ContinuousBatchingLogger").addFilter(lambda record: "psutil" not in record.getMessage())


def load_hf_model(model_path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


# -- static batches ---------------------------------------------------------------------------------------
@torch.inference_mode()
def hf_generate_batch(model, batch: Sequence[BenchRequest]) -> int:
    """One left-padded static batch, greedy, eos disabled, run to the longest member; returns its output length."""
    import transformers

    width = max(r.prompt_len for r in batch)
    input_ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        input_ids[row, width - request.prompt_len:] = torch.tensor(request.prompt_token_ids)
        attention_mask[row, width - request.prompt_len:] = 1
    max_new = max(r.max_tokens for r in batch)
    config = transformers.GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                                           eos_token_id=None, pad_token_id=PAD_ID)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    return out.shape[1] - width


def run_hf_static(model_path: str, requests: Sequence[BenchRequest], args,
                  token_range: Sequence[int] = TOY_TOKEN_RANGE) -> BaselineRun:
    model = load_hf_model(model_path)
    hf_generate_batch(model, warmup_workload(token_range))
    size = args.static_batch_size
    batches = [requests[i:i + size] for i in range(0, len(requests), size)]
    latencies: list[float] = []
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc="hf-static", unit="batch", file=sys.stderr, leave=False):
        length = hf_generate_batch(model, batch)
        latencies.extend([time.perf_counter() - t0] * len(batch))
        if length < max(r.max_tokens for r in batch):
            raise RuntimeError("hf-static: a batch got fewer tokens than its longest request asked for")
    span = time.perf_counter() - t0
    computed = padded_static_batch_tokens([r.prompt_len for r in requests], [r.max_tokens for r in requests], size)
    return BaselineRun("hf-static", span, latencies, computed, {"batch_size": size})


# -- continuous batching --------------------------------------------------------------------------------------
def hf_cb_config(args):
    """The same budget as ours: KV pages of 16 tokens, the same tokens per step and slots."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=BLOCK_SIZE, num_blocks=kv_blocks(args), max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
        allow_block_sharing=False,  # random prompts share no prefix: prefix hashing would only cost time
        seed=args.seed,
    )


def _hf_cb_submit_and_wait(manager, requests: Sequence[BenchRequest], t0: float,
                           on_finish: Callable[[], None] | None = None) -> dict[str, Any]:
    ids = [manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens,
                               eos_token_id=-1) for i, r in enumerate(requests)]
    results: dict[str, Any] = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("hf-cb: the generation thread stopped before every request finished")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"hf-cb: request {result.request_id} failed: {result.error}")
            results[result.request_id] = (result, time.perf_counter() - t0)
            if on_finish:
                on_finish()
    return {rid: results[rid] for rid in ids}


def run_hf_cb(model_path: str, requests: Sequence[BenchRequest], args,
              token_range: Sequence[int] = TOY_TOKEN_RANGE) -> BaselineRun:
    import transformers

    model = load_hf_model(model_path)
    generation_config = transformers.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID,
                                                      max_new_tokens=max(r.max_tokens for r in requests))
    manager = model.init_continuous_batching(generation_config=generation_config,
                                             continuous_batching_config=hf_cb_config(args))
    manager.warmup()
    manager.start()
    try:
        _hf_cb_submit_and_wait(manager, warmup_workload(token_range), time.perf_counter())
        resolved = manager.continuous_batching_config
        with tqdm(total=len(requests), desc="hf-cb", unit="req", file=sys.stderr, leave=False) as bar:
            t0 = time.perf_counter()
            results = _hf_cb_submit_and_wait(manager, requests, t0, lambda: bar.update(1))
            span = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
        manager.destroy()
    outputs = list(results.values())
    wrong = [i for i, ((result, _), r) in enumerate(zip(outputs, requests))
             if len(result.generated_tokens) != r.max_tokens]
    if wrong:
        raise RuntimeError(f"hf-cb: {len(wrong)} request(s) got the wrong number of tokens (first: request {wrong[0]})")
    # lifespan[1] is perf_counter() when the request finished inside the generation thread.
    latencies = [(result.lifespan[1] - t0) if result.lifespan[1] > 0 else received for result, received in outputs]
    return BaselineRun("hf-cb", span, latencies, None,
                       {"attn_implementation": model.config._attn_implementation,
                        "num_blocks": resolved.num_blocks, "page_size": resolved.page_size,
                        "max_batch_tokens": resolved.max_batch_tokens,
                        "max_requests_per_batch": resolved.max_requests_per_batch})
