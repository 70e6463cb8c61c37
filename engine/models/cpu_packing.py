"""A model pass for the CPU: every ``nn.Linear`` also keeps its weight pre-packed for oneDNN.

At decode batch sizes a matmul reads its whole weight for a handful of rows, and on a CPU whose
caches cannot hold the model that read comes from memory every step. oneDNN's blocked layout,
packed once at load, reads it in order: measured on the 2-core benchmark machine with cold caches,
13 rows x the benchmark model's LM head took 1.07 ms against MKL's 2.36 ms on the plain weight, and
its MLP projections 10-25% less; prefill chunks of 1-2k rows run 5-12% faster too (seed workload +3%
over packing only up to 512 rows, alternating runs). A single row too, since 2026-12-05: the model's 17
linears for one row from a cold cache took 1.42-1.47 ms packed against MKL gemv's 1.85 ms on the plain
weight (Zen 4), and a one-row decode step of the benchmark model 2.1-2.5 ms against 2.5-3.0 on one thread,
1.7-2.2 against 2.8 on two (MKL's gemv does not split one row over threads). Between steps the caches do not
keep the weights: a step reads ~16 MB of them and the KV, and this VM's share of the L3 holds ~12-16 MB. The
plain weight stays the module's parameter (loading, tied embeddings); the packed copy costs the linear
weights' memory once more, which is why this is a CPU pass for float32 and not the default elsewhere.

oneDNN keeps a primitive (JIT code and buffers) for every row count it has seen, about 0.6 MB each here and
never given back: with prompts of every length, an engine's memory grew by ~700 MB over its first few
thousand requests (found by benchmarks.soak). So the rows are padded up to one of ~130 sizes (exact up to 16,
then at most 1/16 apart): memory stays bounded, at the cost of computing <= 6% more rows in a prefill chunk. The
model pads a forward's tokens once (``CausalLM.row_padding``), so its linears see bucketed row counts already;
padding each linear's input instead cost 5-9% of a 425-token prefill (allocating, zero-filling and copying 16
activations).
A row's result does not depend on the rows beside it (checked bit for bit: tests/engine/test_cpu_packing.py).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

EXACT_ROWS = 16  # row counts up to this are used as they are (decode batches); above, padded to a bucket


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to the next of a bounded set of sizes: exact up to ``EXACT_ROWS``, then in steps of a
    sixteenth of the power of two below (17-31 by 1, 32-63 by 2, ..., 1024-2047 by 64)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 5)
    return -(-rows // step) * step


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.shape[0]:  # (an empty or batched-3D input keeps the plain weight)
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return out[:rows] if padded != rows else out
    return F.linear(x, self.weight, self.bias)


@torch.no_grad()
def pack_linear_weights(model: nn.Module, expected_rows: int = 64) -> int:
    """Give every float32 ``nn.Linear`` of ``model`` a packed copy of its weight and a forward that uses it
    for every row count; returns how many were packed. ``expected_rows`` is oneDNN's layout hint."""
    if not packing_available():
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), expected_rows)
            module.forward = types.MethodType(_packed_forward, module)
            count += 1
    if count and hasattr(model, "row_padding"):
        model.row_padding = padded_rows  # pad a forward's tokens once, not at each of its linears
    return count
