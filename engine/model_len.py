"""How long a sequence may grow (``max_model_len``): the user's limit, within the model's and the KV cache's."""

from __future__ import annotations

from inflight.engine.models.config import ModelConfig


def model_limit(model: ModelConfig, wanted: int | None) -> int:
    """``wanted`` (None: the model's own limit), checked against the model's positions."""
    limit = model.max_position_embeddings
    if wanted is None:
        return limit
    if wanted > limit:
        raise ValueError(f"max_model_len {wanted} exceeds the model's limit of {limit} positions")
    return wanted


def fit_to_pool(max_model_len: int, wanted: int | None, num_kv_blocks: int, block_size: int) -> tuple[int, str]:
    """``max_model_len`` capped to the KV cache, and a note saying so (else ""): a request must be able to grow to
    max_model_len alone, or it could evict itself forever. A limit the user set that does not fit is an error."""
    capacity = num_kv_blocks * block_size
    if max_model_len <= capacity:
        return max_model_len, ""
    if wanted is not None:
        raise ValueError(f"max_model_len {max_model_len} exceeds the KV cache's capacity of {capacity} tokens "
                         f"({num_kv_blocks} blocks of {block_size}); raise num_kv_blocks or lower max_model_len")
    return capacity, f" (capped by the KV cache: {num_kv_blocks} blocks of {block_size} tokens; raise num_kv_blocks)"
