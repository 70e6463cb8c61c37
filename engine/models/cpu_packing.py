"""A model pass for the CPU: every ``nn.Linear`` also keeps its weight pre-packed, for oneDNN and for our kernel.

At decode batch sizes a matmul reads its whole weight for a handful of rows, and on a CPU whose
caches cannot hold the model that read comes from memory every step. Between steps this VM's caches do not
keep the weights: a step reads ~16 MB of them and the KV, and its share of the L3 holds ~12-16 MB. So both
copies are laid out to be read in order:

* Up to ``kernel_rows()`` rows (decode steps: 16 with AVX-512): ``kernels.cpu_kernels.linear`` on a copy packed as
  [out / 64, in, 64]. oneDNN's matmul costs ~13 us per call before any arithmetic (17 calls a step of the
  benchmark model); this one costs a ctypes call, and streams the weight. A one-row decode step of the benchmark
  model went from 2.01-2.26 ms to 1.19-1.25 ms on one thread, 8 rows 19-29% less, 16 rows 5-13% less
  (``benchmarks.decode_steps``, alternating runs, 2026-12-05); above 16 rows the two were level. Its sums are
  oneDNN's on one thread, bit for bit (tests/kernels/test_cpu_linear.py), so a row gets the same bits whichever
  path its batch size takes: at every row count for up to 1,024 inputs; above that oneDNN sums a lone row
  differently from a batch (and, with several threads, from one thread to another), and the kernel only takes lone
  rows there; a linear with a single output stays with oneDNN, which sums it another way.
* Above: oneDNN's blocked layout, packed once at load. Measured on the 2-core benchmark machine with cold
  caches, 13 rows x the benchmark model's LM head took 1.07 ms against MKL's 2.36 ms on the plain weight,
  and its MLP projections 10-25% less; prefill chunks of 1-2k rows run 5-12% faster too.

The plain weight stays the module's parameter (loading, tied embeddings); the two packed copies cost the linear
weights' memory twice more, which is why this is a CPU pass and not the default elsewhere.

In bfloat16 (where the CPU has bfloat16 instructions, ``engine.device.resolve_dtype``), every row count goes to
``cpu_kernels.linear_pairs`` where the kernels' build has AVX-512 BF16 (a weight packed in pairs of inputs, one
vdpbf16ps per pair; no oneDNN copy, no padding), else to oneDNN's packed bf16 matmul. One path for every batch
size keeps a row's bits independent of its batch, as float32 does: with the kernel for decode-sized batches and
oneDNN above, a prompt found in the prefix cache (its last tokens computed as a small chunk) got another first
token than the same prompt computed whole, at a near-tie of the real model. It costs nothing: the dot-product
kernel beat oneDNN on the model's layer linears at 1-16 rows (Zen 4, 2 threads, 2026-12-06: 576 x 3,072, 34
against 52 us at 1 row, 149 against 160 at 16; 1,536 x 576: 22 against 34, 79 against 95) and ran level with it at
32-512 rows (355-414 against 225-419 GFLOP/s); only the 49,152-wide LM head at 4-8 rows was ~10% slower. Widening
bf16 to float32 in ``cpu_kernels.linear`` lost to oneDNN at every row count but one (576 x 3,072 at 8 rows 211
against 121 us, at 16 rows 531 against 215), so it takes no bf16 matmul.

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

import functools
import types

import torch
import torch.nn.functional as F
from torch import nn

from inflight.kernels import cpu_kernels

EXACT_ROWS = 16  # row counts up to this are used as they are (decode batches); above, padded to a bucket
# Up to how many rows cpu_kernels.linear takes a matmul; None: what the kernels' build says (16 with AVX-512, 8 with
# 8-lane vectors, 0 without FMA instructions: cpu_kernels.linear_max_rows). benchmarks.decode_steps sets it.
KERNEL_ROWS: int | None = None
EXACT_KERNEL_IN_FEATURES = 1024  # where cpu_kernels.linear sums as oneDNN's matmul does at every row count
EVERY_ROW = 1 << 62  # kernel_rows of a linear the kernel takes at every row count


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def kernel_rows() -> int:
    """Up to how many rows a linear goes through ``cpu_kernels.linear``: ``KERNEL_ROWS``, else the build's own limit."""
    if cpu_kernels.load() is None:
        return 0
    return KERNEL_ROWS if KERNEL_ROWS is not None else cpu_kernels.linear_max_rows()


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
        if rows <= self.kernel_rows:
            if x.dtype is torch.bfloat16:
                return cpu_kernels.linear_pairs(x, self.kernel_weight, self.bias, self.out_features)
            return cpu_kernels.linear(x, self.kernel_weight, self.bias, self.out_features)
        padded = padded_rows(rows)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return out[:rows] if padded != rows else out
    return F.linear(x, self.weight, self.bias)


def _float32_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The bf16 linear's sums unrounded, as float32 (the LM head's logits: ``CausalLM.compute_logits``)."""
    if x.dim() == 2 and x.shape[0]:
        return cpu_kernels.linear_pairs(x, self.kernel_weight, self.bias, self.out_features, torch.float32)
    return F.linear(x, self.weight, self.bias).float()


@torch.no_grad()
def pack_expert_weights(model: nn.Module) -> int:
    """Give every bfloat16 ``Experts`` module (a MoE layer's) a ``kernel``: all its experts in one call of
    ``cpu_kernels.moe_experts`` on packed copies of its weights, by ``linear_pairs`` as the dense linears. Where the
    build has no AVX-512 BF16, and for float32, the experts stay a loop over PyTorch linears (oneDNN's). Returns how
    many were given one. (``benchmarks.micro.moe_experts``: the kernel against that loop.)"""
    from inflight.engine.models.llama import Experts

    if not cpu_kernels.bf16_dot_products():
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, Experts) and module.gate_up_proj.dtype is torch.bfloat16 \
                and module.gate_up_proj.device.type == "cpu":
            module.kernel = functools.partial(cpu_kernels.moe_experts, gate_up=cpu_kernels.pack_experts(
                module.gate_up_proj.detach()), down=cpu_kernels.pack_experts(module.down_proj.detach()),
                inter=module.intermediate_size)
            count += 1
    return count


def pack_linear_weights(model: nn.Module, expected_rows: int = 64) -> int:
    """Give every float32 or bfloat16 ``nn.Linear`` of ``model`` packed copies of its weight and a forward that uses
    them for every row count; returns how many were packed. float32 (and bf16 without the dot-product kernel):
    oneDNN's copy, and the decode kernel's when the CPU kernels are built; bf16 with it: ``linear_pairs``' copy
    alone. ``expected_rows`` is oneDNN's layout hint."""
    if not packing_available():
        return 0
    max_rows = kernel_rows()
    count, onednn = 0, False
    for module in model.modules():
        if (isinstance(module, nn.Linear) and module.weight.dtype in cpu_kernels.DTYPES
                and module.weight.device.type == "cpu"):
            count += 1
            module.forward = types.MethodType(_packed_forward, module)
            if module.weight.dtype == torch.bfloat16 and cpu_kernels.bf16_dot_products():  # see above
                module.kernel_rows = EVERY_ROW
                module.kernel_weight = cpu_kernels.pack_linear_pairs(module.weight)
                module.float32_forward = types.MethodType(_float32_forward, module)
                continue
            onednn = True
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), expected_rows)
            # oneDNN's sums, bit for bit (one thread): at every row count up to 1,024 inputs, above only a lone row's
            if module.weight.dtype != torch.float32:  # bf16 without the dot-product kernel: oneDNN (see above)
                module.kernel_rows = 0
            elif module.out_features < 2:  # a single output oneDNN sums another way
                module.kernel_rows = 0
            elif module.in_features <= EXACT_KERNEL_IN_FEATURES:
                module.kernel_rows = max_rows
            else:
                module.kernel_rows = min(max_rows, 1)
            if module.kernel_rows:
                module.kernel_weight = cpu_kernels.pack_linear(module.weight)
    if onednn and hasattr(model, "row_padding"):  # (the kernels keep no state per row count: no padding for them)
        model.row_padding = padded_rows  # pad a forward's tokens once, not at each of its linears
    return count
