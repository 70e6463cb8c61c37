"""Other systems on the same requests: transformers (``hf_baselines``) and vLLM (``vllm_baseline``,
``serve_vs_vllm``). The ``vllm_*.py`` scripts are run by the peer's own Python (a separate virtualenv), never
imported with it: they and ``kv_budget``/``preload`` use the standard library only at module level."""
