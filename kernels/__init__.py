"""Attention kernels behind one small interface. Knows tensors and block tables, never requests."""

from kernels.backend import AttentionBackend, BatchLayout, get_attention_backend

__all__ = ["AttentionBackend", "BatchLayout", "get_attention_backend"]
