"""Scripts run by a peer system's own Python (a separate virtualenv), never imported with that system:
standard library only at module level, so ``benchmarks.vllm_baseline`` can share ``kv_budget`` with them."""
