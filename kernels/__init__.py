"""Attention kernels behind one small interface. Knows tensors and block tables, never requests."""

# This folder is the package inflight.kernels (pyproject.toml). Imported by the folder's own name from a checkout
# (transformers probes for Hugging Face's ``kernels`` that way, and finds no version: not theirs), this module is a
# shell over inflight.kernels' names with no submodules of its own, so that no module is loaded twice. (engine/ and
# serve_app/ refuse their folders' names outright: nobody probes for those.)
if __name__ == "kernels":
    __path__: list[str] = []

from inflight.kernels.backend import AttentionBackend, BatchLayout, get_attention_backend

__all__ = ["AttentionBackend", "BatchLayout", "get_attention_backend"]
