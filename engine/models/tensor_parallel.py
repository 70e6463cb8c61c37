"""Tensor parallelism as a transform of the model (as gpt-fast does it): one rank's share of a loaded ``CausalLM``,
so ``models/llama.py`` stays the one readable definition (issue 42, its first stage: the model's math).

Megatron's split, two collectives a layer:

* q/k/v and gate/up are cut by output rows (column-parallel): each rank holds its query heads, the KV heads they
  read, and its share of the MLP's intermediate width, and computes them from the whole input with no traffic;
* o and down are cut by input columns (row-parallel): each rank's partial sums are all-reduced (a bias is added on
  rank 0 only, so it is counted once);
* the embedding and the LM head are cut by vocabulary rows: a token's embedding comes from the rank holding it
  (zeros elsewhere, all-reduced: exact), and the logits are gathered once, in order.

KV heads are dealt to the ranks whole, each with the query heads that read it: as evenly as they go when there are at
least as many KV heads as ranks (SmolLM2's 3 on 2 ranks: 1 and 2, the MLP's width then dealt to even out the weights),
or replicated when the ranks are a multiple of them (each rank holds the one KV head its query heads share). Other
sizes are a ``ValueError`` naming ``tensor_parallel_size`` and listing the sizes the model allows. The collectives are
``engine.parallel.collectives``' (shared memory between CPU ranks, NCCL between GPUs).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from inflight.engine.models.config import ModelConfig
from inflight.engine.models.llama import SparseMoE
from inflight.engine.parallel.collectives import Collectives


def sizes_allowed(cfg: ModelConfig, up_to: int = 64) -> list[int]:
    """The tensor-parallel sizes up to ``up_to`` this model can be cut into."""
    return [size for size in range(1, up_to + 1) if not _problems(cfg, size)]


def _problems(cfg: ModelConfig, size: int) -> list[str]:
    problems = []
    group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
    if size > cfg.num_kv_heads and (size % cfg.num_kv_heads or group % (size // cfg.num_kv_heads)):
        problems.append(f"{cfg.num_kv_heads} KV heads of {group} query heads each (a size must be at most the KV "
                        f"heads, or a multiple of them that divides each one's query heads)")
    if cfg.intermediate_size < size:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    if cfg.num_experts and cfg.moe_intermediate_size < size:
        problems.append(f"experts' intermediate size {cfg.moe_intermediate_size}")
    return problems


def check_tensor_parallel_size(cfg: ModelConfig, size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size: must be a positive integer, got {size!r}")
    problems = _problems(cfg, size)
    if problems:
        raise ValueError(f"tensor_parallel_size: {size} cannot cut the model's {' and '.join(problems)}; "
                         f"this model allows {', '.join(map(str, sizes_allowed(cfg)))}")


def _share(total: int, rank: int, size: int) -> tuple[int, int]:
    """(first, count) of ``rank``'s part of ``total`` things dealt to ``size`` ranks as evenly as they go."""
    first = rank * total // size
    return first, (rank + 1) * total // size - first


def _mlp_shares(cfg: ModelConfig, size: int) -> list[int]:
    """Each rank's part of the MLP's intermediate width, chosen so that every rank's layer weights (its q/k/v and o
    rows plus its MLP rows) come out as equal as they can: even when the heads split evenly, more MLP for the ranks
    with fewer KV heads when they do not (SmolLM2 on 2 ranks: 864 and 672 of 1,536), so neither waits on the other
    at the all-reduces. In multiples of 32 where the width allows (a quantized block's inputs)."""
    group, hd, hidden = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    if size > cfg.num_kv_heads:  # replicated KV heads: every rank holds as many heads
        attention = [0] * size
    else:
        kv = [_share(cfg.num_kv_heads, rank, size)[1] for rank in range(size)]
        attention = [(2 * k * group + 2 * k) * hd * hidden for k in kv]  # q and o, k and v
    unit = 32 if cfg.intermediate_size % (32 * size) == 0 else 1
    units, per_unit = cfg.intermediate_size // unit, 3 * hidden * unit  # gate, up and down rows
    target = (sum(attention) + units * per_unit) / size
    shares = [max(1, round((target - a) / per_unit)) for a in attention]
    shares[-1] += units - sum(shares)  # (rounding: the last rank takes the remainder)
    if min(shares) < 1:
        shares = [_share(units, rank, size)[1] for rank in range(size)]
    return [share * unit for share in shares]


@dataclasses.dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``size`` holds: ranges of query heads, KV heads and the MLP's intermediate width
    (``_mlp_shares``), and ``vocab_rows`` rows of the vocabulary (padded so every rank holds as many)."""

    rank: int
    size: int
    first_head: int
    heads: int
    first_kv_head: int
    kv_heads: int
    first_intermediate: int
    intermediate: int
    vocab_rows: int
    first_expert_intermediate: int = 0  # each expert's width, cut as the dense MLP's (mixture of experts)
    expert_intermediate: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> Shard:
        check_tensor_parallel_size(cfg, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank: must be in [0, {size}), got {rank}")
        group = cfg.num_heads // cfg.num_kv_heads
        if size <= cfg.num_kv_heads:  # whole KV heads, each with its query heads
            first_kv, kv_heads = _share(cfg.num_kv_heads, rank, size)
            first_head, heads = first_kv * group, kv_heads * group
        else:  # replicated: size // num_kv_heads ranks share a KV head, each with its part of that head's queries
            heads = cfg.num_heads // size
            first_head, first_kv, kv_heads = rank * heads, rank * heads // group, 1
        shares = _mlp_shares(cfg, size)
        return cls(rank, size, first_head, heads, first_kv, kv_heads, sum(shares[:rank]), shares[rank],
                   -(-cfg.vocab_size // size), *_share(cfg.moe_intermediate_size, rank, size))


class RowParallel(nn.Module):
    """A linear over this rank's input columns; the ranks' partial sums all-reduced."""

    def __init__(self, linear: nn.Linear, comm: Collectives) -> None:
        super().__init__()
        self.linear, self.comm = linear, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).contiguous()
        self.comm.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the vocabulary; other ids give zeros here and their rank's row after the sum."""

    def __init__(self, weight: torch.Tensor, start: int, comm: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine[..., None].to(self.weight.dtype)
        self.comm.all_reduce(out)
        return out


class VocabParallelHead(nn.Module):
    """This rank's vocabulary rows of the LM head (an ``nn.Linear``, so the CPU packing takes it too); the logits,
    float32, gathered on rank 0 in vocabulary order, where the sampler is. Other ranks get None."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, comm: Collectives) -> None:
        super().__init__()
        self.linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.linear.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.comm = vocab_size, comm

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        exact = getattr(self.linear, "float32_forward", None)  # unrounded sums of a packed bf16 head
        return exact(x) if exact is not None else self.linear(x).float()

    def float32_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = self.comm.gather(self._local(x))
        return None if parts is None else torch.cat(parts, dim=-1)[..., :self.vocab_size]

    forward = float32_forward

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's most likely token, from each rank's best (value, token) alone: the first rank holding the
        row's maximum has its first occurrence, as ``argmax`` over the whole row would find."""
        local = self._local(x)
        start = self.comm.rank * self.linear.out_features
        real = self.vocab_size - start  # the last rank's rows past the vocabulary are padding
        if real < local.shape[-1]:
            local[..., max(real, 0):] = float("-inf")
        values, index = local.max(dim=-1)
        parts = self.comm.gather(torch.stack([values.double(), (index + start).double()], dim=-1))
        if parts is None:
            return None
        best = torch.stack(parts)  # [ranks, rows, (value, token)]
        rank = best[..., 0].argmax(dim=0)  # the first rank with the maximum
        return best[rank, torch.arange(best.shape[1]), 1].long()


@dataclasses.dataclass(frozen=True)
class _Ranges:
    """A shard's slices of the model's dimensions: both cuts (``shard_model``, ``cut_tensors``) take them from here."""

    heads: slice  # of the query rows (head_dim each)
    kv: slice  # of the key (or value) rows
    inter: slice  # of the dense MLP's width
    expert: slice  # of each expert's width
    vocab: slice  # of the padded vocabulary


def _ranges(cfg: ModelConfig, s: Shard) -> _Ranges:
    hd = cfg.head_dim
    return _Ranges(slice(s.first_head * hd, (s.first_head + s.heads) * hd),
                   slice(s.first_kv_head * hd, (s.first_kv_head + s.kv_heads) * hd),
                   slice(s.first_intermediate, s.first_intermediate + s.intermediate),
                   slice(s.first_expert_intermediate, s.first_expert_intermediate + s.expert_intermediate),
                   slice(s.rank * s.vocab_rows, (s.rank + 1) * s.vocab_rows))


def _shifted(part: slice, by: int) -> slice:
    return slice(part.start + by, part.stop + by)


def _halves(t: torch.Tensor, part: slice, width: int, dim: int) -> torch.Tensor:
    """``part`` of both halves (gate and up, ``width`` each) of ``t`` along ``dim``, side by side (a new tensor)."""
    return torch.cat([t.narrow(dim, part.start, part.stop - part.start),
                      t.narrow(dim, width + part.start, part.stop - part.start)], dim)


def _vocab_part(weight: torch.Tensor, cfg: ModelConfig, s: Shard) -> torch.Tensor:
    """The shard's rows of an embedding or LM head, the vocabulary padded to ``size`` x ``vocab_rows`` (zeros)."""
    return F.pad(weight, (0, 0, 0, s.vocab_rows * s.size - cfg.vocab_size))[_ranges(cfg, s).vocab].clone()


def cut_tensors(tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig,
                shard: Shard) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors (Hugging Face names, as the loader reads them, one at a time) cut to ``shard``'s part,
    named as ``shard_model``'s modules hold them: what the loader places into a model cut before it was allocated.
    The same cut as ``shard_model``'s on a whole model (tests/engine/test_tensor_parallel.py holds them equal)."""
    r = _ranges(cfg, shard)
    rows = {"q_proj": r.heads, "k_proj": r.kv, "v_proj": r.kv, "gate_proj": r.inter, "up_proj": r.inter}
    columns = {"o_proj": r.heads, "down_proj": r.inter}  # row-parallel: a RowParallel's .linear
    for name, tensor in tensors:
        module, _, kind = name.rpartition(".")
        part = module.rpartition(".")[2]
        if ".experts." in name:  # an expert's matrices (gate/up rows, down columns), or all experts' stacked
            if kind == "gate_up_proj":
                yield name, _halves(tensor, r.expert, cfg.moe_intermediate_size, dim=1)
            elif kind == "down_proj":
                yield name, tensor[:, :, r.expert]
            elif part in ("down_proj", "w2"):
                yield name, tensor[:, r.expert]
            else:
                yield name, tensor[r.expert]
        elif part in rows:
            yield name, tensor[rows[part]]
        elif part in columns:
            if kind == "weight":
                yield f"{module}.linear.weight", tensor[:, columns[part]]
            elif shard.rank == 0:  # a bias counted once
                yield f"{module}.linear.bias", tensor
        elif part in ("embed_tokens", "lm_head"):
            if part == "lm_head" and cfg.tie_word_embeddings:
                continue
            yield (name if part == "embed_tokens" else "lm_head.linear.weight"), _vocab_part(tensor, cfg, shard)
        else:
            yield name, tensor


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return linear


def _cut_experts(moe: SparseMoE, s: Shard, expert: slice, comm: Collectives) -> None:
    experts = moe.experts
    experts.gate_up_proj = nn.Parameter(_halves(experts.gate_up_proj, expert, experts.intermediate_size, dim=1),
                                        requires_grad=False)
    experts.down_proj = nn.Parameter(experts.down_proj[:, :, expert].clone(), requires_grad=False)
    experts.intermediate_size = s.expert_intermediate
    moe.all_reduce = comm.all_reduce if comm is not None else None


@torch.no_grad()
def shard_model(model: nn.Module, shard: Shard, comm: Collectives) -> nn.Module:
    """Cut a loaded ``CausalLM`` (its full weights) down to ``shard``'s part, in place; returns it. Run before any
    CPU packing (``cpu_packing`` then packs the cut linears)."""
    cfg, s = model.config, shard
    r = _ranges(cfg, s)
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv_rows = [r.heads, _shifted(r.kv, q_size), _shifted(r.kv, q_size + kv_size)]  # (a new tensor: the whole can go)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj
        attn.qkv_proj = _linear(torch.cat([qkv.weight[rows] for rows in qkv_rows]),
                                torch.cat([qkv.bias[rows] for rows in qkv_rows]) if qkv.bias is not None else None)
        o = attn.o_proj
        attn.o_proj = RowParallel(_linear(o.weight[:, r.heads].clone(),
                                          o.bias if o.bias is not None and s.rank == 0 else None), comm)
        attn.num_heads, attn.num_kv_heads = s.heads, s.kv_heads
        attn.q_size, attn.kv_size = s.heads * cfg.head_dim, s.kv_heads * cfg.head_dim
        if isinstance(mlp, SparseMoE):  # each expert cut as the dense MLP: its width's part; the sum all-reduced
            _cut_experts(mlp, s, r.expert, comm)
            continue
        mlp.gate_up_proj = _linear(_halves(mlp.gate_up_proj.weight, r.inter, cfg.intermediate_size, dim=0), None)
        mlp.down_proj = RowParallel(_linear(mlp.down_proj.weight[:, r.inter].clone(), None), comm)
        mlp.intermediate_size = s.intermediate
    embedding = VocabParallelEmbedding(_vocab_part(model.model.embed_tokens.weight, cfg, s), r.vocab.start, comm)
    model.model.embed_tokens = embedding
    head_rows = embedding.weight if cfg.tie_word_embeddings else _vocab_part(model.lm_head.weight, cfg, s)
    model.lm_head = VocabParallelHead(head_rows, cfg.vocab_size, comm)  # (tied: the embedding's own rows)
    return model
