"""Run one workload through vLLM's offline engine and write what happened as JSON.

This file is executed by the Python of a separate virtualenv that holds vLLM (``make peer-venv``),
never imported by ours: it uses the standard library and vLLM only. ``benchmarks.peers.vllm_baseline``
writes the job (checkpoint, token-id prompts, output lengths, engine sizes, the KV override) to a JSON
file, runs

    PEER_PYTHON benchmarks/peers/vllm_offline.py JOB.json RESULT.json

and reads back the result: per request the seconds from the first submission to its completion,
each request's output length, the KV cache vLLM ended up with, its version and environment.

Every request is added at t=0 and the engine is stepped until all are done, the way ``LLM.generate``
drives it (final outputs only); stepping it here lets each completion be timed (``LLM.generate`` returns
only at the end).
"""

from __future__ import annotations

import json
import os
import sys
import time


def build_llm(job: dict):
    from vllm import LLM

    return LLM(
        model=job["model"],
        dtype=job["dtype"],
        block_size=job["block_size"],
        # exactly the KV budget: vLLM holds one block back, and sizes the pool by bytes as well as blocks
        num_gpu_blocks_override=job["num_gpu_blocks_override"],
        kv_cache_memory_bytes=job["kv_cache_memory_bytes"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_model_len=job["max_model_len"],
        enforce_eager=job["enforce_eager"],
        seed=0,
    )


def params(max_tokens: int, temperature: float = 0.0, top_p: float = 1.0, ignore_eos: bool = True):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # FINAL_ONLY as LLM.generate sets it: the default (cumulative) builds every running request's output
    # at every step, work LLM.generate does not do.
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, ignore_eos=ignore_eos,
                          detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)


def run(llm, prompts: list[list[int]], output_lens: list[int], sampling: list | None = None,
        ignore_eos: list | None = None) -> tuple[list[float], list[int]]:
    """Add every request at once, step until done; per request (seconds to completion, tokens generated).
    ``ignore_eos``: per request, False where it stops at the model's end of sequence (default: none does)."""
    engine = llm.llm_engine
    done_s: list[float | None] = [None] * len(prompts)
    num_tokens = [0] * len(prompts)
    started = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        temperature, top_p = sampling[i] if sampling else (0.0, 1.0)
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           params(n, temperature, top_p, ignore_eos[i] if ignore_eos else True))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                i = int(output.request_id)
                done_s[i] = time.perf_counter() - started
                num_tokens[i] = len(output.outputs[0].token_ids)
    return done_s, num_tokens  # type: ignore[return-value]


def kv_cache_report(llm) -> dict:
    """What vLLM resolved: its block count (the held-back block included) and the "KV cache size: N tokens"
    it logs (blocks x block size, the held-back block included)."""
    cache_config = llm.llm_engine.vllm_config.cache_config
    return {"num_gpu_blocks": getattr(cache_config, "num_gpu_blocks", None),
            "kv_cache_size_tokens": getattr(cache_config, "kv_cache_size_tokens", None)}


def main(job_path: str, result_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    llm = build_llm(job)
    # Warm-up: the first steps of every shape pay for compilation and first-touch allocations.
    warm = job["warmup"]
    run(llm, warm["prompts"], warm["output_lens"])
    done_s, num_tokens = run(llm, job["prompts"], job["output_lens"], job.get("sampling"), job.get("ignore_eos"))
    import vllm

    result = {"vllm_version": vllm.__version__, "done_s": done_s, "num_tokens": num_tokens, **kv_cache_report(llm),
              "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU") or k == "LD_PRELOAD"}}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the entry point must be guarded
    sys.exit(main(sys.argv[1], sys.argv[2]))
