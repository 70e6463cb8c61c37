"""Tensor parallelism as a transform of the model (as gpt-fast does it): one rank's share of a loaded ``CausalLM``,
so ``models/llama.py`` stays the one readable definition (issue 42, its first stage: the model's math).

Megatron's split, two collectives a layer:

* q/k/v and gate/up are cut by output rows (column-parallel): each rank holds its query heads, the KV heads they
  read, and its share of the MLP's intermediate width, and computes them from the whole input with no traffic;
* o and down are cut by input columns (row-parallel): each rank's partial sums are all-reduced (a bias is added on
  rank 0 only, so it is counted once);
* the embedding and the LM head are cut by vocabulary rows: a token's embedding comes from the rank holding it
  (zeros elsewhere, all-reduced: exact), and the logits are gathered once, in order.

KV heads fewer than ranks are replicated: with ``size`` a multiple of ``num_kv_heads`` each rank holds the one KV head
its query heads share. Sizes that divide neither way are a ``ValueError`` naming ``tensor_parallel_size`` and listing
the sizes the model allows. Collectives are ``torch.distributed``'s all-reduce and all-gather (a list), which gloo
(CPU) and NCCL (GPU) both have.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from inflight.engine.models.config import ModelConfig


def sizes_allowed(cfg: ModelConfig, up_to: int = 64) -> list[int]:
    """The tensor-parallel sizes up to ``up_to`` this model can be cut into."""
    return [size for size in range(1, up_to + 1) if not _problems(cfg, size)]


def _problems(cfg: ModelConfig, size: int) -> list[str]:
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} query heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (a size must divide them or be a multiple of them)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    return problems


def check_tensor_parallel_size(cfg: ModelConfig, size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size: must be a positive integer, got {size!r}")
    problems = _problems(cfg, size)
    if problems:
        raise ValueError(f"tensor_parallel_size: {size} does not divide the model's {' and '.join(problems)}; "
                         f"this model allows {', '.join(map(str, sizes_allowed(cfg)))}")


@dataclasses.dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``size`` holds."""

    rank: int
    size: int
    heads: int  # query heads
    first_kv_head: int
    kv_heads: int  # KV heads (one, replicated, when the model has fewer than ranks)
    intermediate: int
    vocab_rows: int  # rows of the (padded) vocabulary

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> Shard:
        check_tensor_parallel_size(cfg, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank: must be in [0, {size}), got {rank}")
        heads = cfg.num_heads // size
        kv_heads = max(cfg.num_kv_heads // size, 1)
        first_kv = rank * cfg.num_kv_heads // size  # replicated: the group this rank's query heads read
        return cls(rank, size, heads, first_kv, kv_heads, cfg.intermediate_size // size,
                   -(-cfg.vocab_size // size))


class RowParallel(nn.Module):
    """A linear over this rank's input columns; the ranks' partial sums all-reduced."""

    def __init__(self, linear: nn.Linear, group) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the vocabulary; other ids give zeros here and their rank's row after the sum."""

    def __init__(self, weight: torch.Tensor, start: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine[..., None].to(self.weight.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """This rank's vocabulary rows of the LM head; the logits gathered in vocabulary order (float32)."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, group) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.group = vocab_size, group

    def float32_forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).float().contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]

    forward = float32_forward


def _rows(t: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t[a:b] for a, b in ranges])  # (a new tensor: the full weight can go)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return linear


@torch.no_grad()
def shard_model(model: nn.Module, shard: Shard, group=None) -> nn.Module:
    """Cut a loaded ``CausalLM`` (its full weights) down to ``shard``'s part, in place; returns it. Run before any
    CPU packing (``cpu_packing`` then packs the cut linears)."""
    cfg = model.config
    hd, s = cfg.head_dim, shard
    q_size, kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
    q = (s.rank * s.heads * hd, (s.rank + 1) * s.heads * hd)
    k = (q_size + s.first_kv_head * hd, q_size + (s.first_kv_head + s.kv_heads) * hd)
    v = (k[0] + kv_size, k[1] + kv_size)
    inter = (s.rank * s.intermediate, (s.rank + 1) * s.intermediate)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj
        attn.qkv_proj = _linear(_rows(qkv.weight, [q, k, v]),
                                _rows(qkv.bias, [q, k, v]) if qkv.bias is not None else None)
        o = attn.o_proj
        attn.o_proj = RowParallel(_linear(o.weight[:, q[0]:q[1]].clone(),
                                          o.bias if o.bias is not None and s.rank == 0 else None), group)
        attn.num_heads, attn.num_kv_heads = s.heads, s.kv_heads
        attn.q_size, attn.kv_size = s.heads * hd, s.kv_heads * hd
        gate_up, width = mlp.gate_up_proj, cfg.intermediate_size
        mlp.gate_up_proj = _linear(_rows(gate_up.weight, [inter, (width + inter[0], width + inter[1])]), None)
        mlp.down_proj = RowParallel(_linear(mlp.down_proj.weight[:, inter[0]:inter[1]].clone(), None), group)
        mlp.intermediate_size = s.intermediate
    start = s.rank * s.vocab_rows
    padded = F.pad(model.model.embed_tokens.weight, (0, 0, 0, s.vocab_rows * s.size - cfg.vocab_size))
    embedding = VocabParallelEmbedding(padded[start:start + s.vocab_rows].clone(), start, group)
    model.model.embed_tokens = embedding
    if cfg.tie_word_embeddings:
        head_rows = embedding.weight
    else:
        head_rows = F.pad(model.lm_head.weight, (0, 0, 0, s.vocab_rows * s.size - cfg.vocab_size))
        head_rows = head_rows[start:start + s.vocab_rows].clone()
    model.lm_head = VocabParallelHead(head_rows, cfg.vocab_size, group)  # (tied: the embedding's own rows)
    return model
