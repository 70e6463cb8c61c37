"""Time vLLM's ``LLM.generate`` of one prompt at a time (``max_tokens`` 1) and write the times as JSON.

Executed by the Python of the virtualenv that holds vLLM (``make peer-venv``), never imported by ours (the
standard library and vLLM only), for ``benchmarks.offline.one_prompt``:

    PEER_PYTHON benchmarks/peers/vllm_one_prompt.py JOB.json RESULT.json

The job is ``benchmarks.peers.vllm_baseline.build_job``'s (the checkpoint and the engine's sizes) with
``prompts_by_length``: {length: [token-id prompts]}. The result: ``times_s`` {length: [seconds per prompt, in
order]} (the caller drops its warm-up prompts), vLLM's version and its ``VLLM_CPU`` environment.
"""

from __future__ import annotations

import json
import os
import sys
import time

from vllm_offline import build_llm, params  # beside this file


def main() -> int:
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    import vllm

    llm = build_llm(job)
    one_token = params(1)
    times: dict[str, list[float]] = {}
    for length, prompts in job["prompts_by_length"].items():
        times[length] = []
        for prompt in prompts:
            started = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], one_token, use_tqdm=False)
            times[length].append(time.perf_counter() - started)
    with open(result_path, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "times_s": times,
                   "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}}, f)
    return 0


if __name__ == "__main__":  # vLLM's engine process is spawned: the guard keeps it from running this again
    raise SystemExit(main())
