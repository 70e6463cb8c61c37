"""C++ kernels for the CPU (float32 and bfloat16), built on first use with the system's C++ compiler, called through ctypes.

* ``paged_decode_attention``: decode rows against the paged KV cache, read in place (no gathered copy);
* ``store_kv``: the step's new K/V into the cache;
* ``linear``: a decode step's few rows times a weight packed once (``pack_linear``), with oneDNN's sums;
* ``rms_norm`` (with the residual add), ``silu_and_mul``, ``apply_rope``: the per-token work between the
  matmuls in one pass each, with ``kernels.triton_fused``'s signatures (the model takes either module);
* ``decode_layers``: a bf16 decode step's decoder layers, those kernels in the model's order in one call
  (``engine.models.cpu_decode``).

Each takes float32 or bfloat16 tensors (all of one dtype; RoPE's cos/sin tables are float32 either way) and
computes in float32: a bfloat16 value widens exactly on load and the result is rounded once on store, so bfloat16
halves the bytes a memory-bound decode step reads without summing in bfloat16.

No new dependency and no torch headers: each kernel is a plain ``extern "C"`` function over raw
pointers (``kernels/csrc/*.cpp``), compiled with ``-O3 -march=native -fopenmp`` into a shared library
cached under ``$INFLIGHT_KERNEL_CACHE`` (default ``~/.cache/inflight/kernels``), keyed by the source,
the flags and the CPU, so it is built once per machine (about a second). The kernels work on vectors of the
machine's widest float register (16 lanes with AVX-512, else 8); ``INFLIGHT_CPU_KERNEL_LANES=8`` or ``16`` builds
the other width, which the tests use to run both on any machine. OpenMP resolves to the
libgomp torch has already loaded, so the kernels share torch's thread pool. ctypes releases the GIL
for the call.

``load()`` returns None when no compiler is found or the build fails (the reason is logged once);
callers then keep the PyTorch path. ``INFLIGHT_CPU_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# No -ffast-math: NaN and inf keep their meaning. -fno-trapping-math and -fno-math-errno (as torch is built)
# let float selects and floor vectorise.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17"]


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
        return "\n".join(wanted)
    except OSError:
        return platform.processor()


def _flags() -> list[str]:
    lanes = os.environ.get("INFLIGHT_CPU_KERNEL_LANES")
    if lanes is None:
        return FLAGS
    if lanes not in ("8", "16"):
        raise ValueError(f"INFLIGHT_CPU_KERNEL_LANES must be 8 or 16, got {lanes!r}")
    return [*FLAGS, f"-DINFLIGHT_LANES={lanes}"]


def _cache_dir() -> Path:
    root = os.environ.get("INFLIGHT_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "inflight" / "kernels"


def build(compiler: str, flags: list[str], library: Path, source: Path = SOURCE) -> None:
    """Compile ``source`` (the kernels' C++ file, or another revision of it: ``benchmarks.decode_kernels``) into
    the shared library ``library``."""
    library.parent.mkdir(parents=True, exist_ok=True)
    # Written beside its final name, then renamed: concurrent builders never load a half-written file.
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        out = Path(tmp) / library.name
        # (-I: the headers it includes, from this checkout, wherever ``source`` lies)
        subprocess.run([compiler, *flags, f"-I{SOURCE.parent}", str(source), "-o", str(out)], check=True,
                       capture_output=True, text=True)
        os.replace(out, library)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no compiler, a failed build, or turned off)."""
    if os.environ.get("INFLIGHT_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        logger.warning("no C++ compiler found: CPU attention stays on the PyTorch path (slower decode)")
        return None
    flags = _flags()
    sources = [path.read_text() for path in sorted(SOURCE.parent.iterdir()) if path.suffix in (".cpp", ".h")]
    key = hashlib.sha256("\n".join([*sources, compiler, *flags, _cpu_signature()]).encode()).hexdigest()
    library = _cache_dir() / f"cpu_kernels-{key[:16]}.so"
    try:
        if not library.exists():
            build(compiler, flags, library)
        lib = declare(ctypes.CDLL(str(library)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("building the CPU kernels failed, attention stays on the PyTorch path: %s", detail[-2000:])
        return None
    return lib


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (a build of the kernels) with every export's argument and result types declared; returns it. An
    export the build lacks is skipped: another revision's build (``benchmarks.decode_kernels``) may predate it."""
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures = {
        "causal_attention": [ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32, i32],
        "paged_decode_attention": [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, i32, i64, f32],
        "rms_norm": [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, i32],
        "silu_and_mul": [ptr, ptr, i64, i64, i64, i32],
        "rope": [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32],
        "store_kv": [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, i64, i32],
        "linear": [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32],
    }
    exports = {f"{name}_{suffix}": (argtypes, None) for name, argtypes in signatures.items()
               for suffix in SUFFIXES.values()}
    exports.update({
        "linear_max_rows": ([], i32), "bf16_dot_products": ([], i32),
        "linear_pairs_bf16": (signatures["linear"], None), "linear_pairs_bf16_f32": (signatures["linear"], None),
        "rms_norm_bf16_f32res": (signatures["rms_norm"], None),
        "decode_layers_bf16": ([ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, *[i64] * 8, f32, f32, i32], None),
        "quant_vnni": ([], i32),
        **{f"quant_linear_{fmt}_{suffix}": ([ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32], None)
           for fmt in ("q4", "q8") for suffix in ("f32", "bf16", "bf16_f32")},
        **{f"quant_rows_{fmt}_{suffix}": ([ptr, ptr, i64, i64, ptr, i32], None)
           for fmt in ("q4", "q8") for suffix in ("f32", "bf16")},
        **{f"shm_all_reduce_{suffix}": ([ptr, ptr, i64, i64, i64, ctypes.c_uint64, ptr, i64, i64, i64], i32)
           for suffix in SUFFIXES.values()},
        **{f"shm_sum_{suffix}": ([ptr, i64, ptr, i64, i64], None) for suffix in SUFFIXES.values()},
        "moe_experts_bf16": ([ptr, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i32], None),
    })
    for name, (argtypes, restype) in exports.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    lib.has_bf16_dot = bool(lib.bf16_dot_products())  # read once: linear_pairs checks it at every call
    return lib


SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # each kernel's exported name per storage dtype
DTYPES = tuple(SUFFIXES)


def _lib() -> ctypes.CDLL:
    lib = load()
    assert lib is not None, "the CPU kernels are not built here (check kernels.cpu_kernels.load() first)"
    return lib


def _kernel(name: str, *tensors: torch.Tensor):
    """The kernel ``name`` for the tensors' dtype (float32 or bfloat16, one for all of them), checked."""
    dtype = tensors[0].dtype
    # (is_cpu, not device.type: that builds a torch.device per call, and these run a few dozen times a step)
    for t in tensors:
        assert t.dtype is dtype and t.is_cpu, "the CPU kernels take CPU tensors of one dtype"
    suffix = SUFFIXES.get(dtype)
    assert suffix is not None, f"the CPU kernels take float32 or bfloat16, not {dtype}"
    return getattr(_lib(), f"{name}_{suffix}")


def _check_tables(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.dtype is torch.float32 and t.is_cpu, "RoPE's cos/sin tables are float32 CPU tensors"


def bf16_hardware() -> str | None:
    """Which bfloat16 instructions this CPU has, as /proc/cpuinfo names them ("amx_bf16", "avx512_bf16"), or None:
    where bfloat16 runs on the CPU's own matrix or vector units instead of being emulated in float32."""
    flags = set()
    for line in _cpu_signature().splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return next((flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags), None)


def _check_index(*tensors: torch.Tensor) -> None:
    # The kernels read these through raw int64 pointers: another dtype would read the wrong memory.
    for t in tensors:
        assert t.dtype is torch.int64 and t.is_cpu, "block tables, lengths and slots must be int64"


def bf16_dot_products() -> bool:
    """Whether this build's bfloat16 attention runs on AVX-512 BF16's dot products (heads of a multiple of 32; causal
    and decode: the scores and the V pass, its softmax weights rounded to bfloat16 as transformers' bf16 attention
    rounds them) rather than widening to float32 (the float32 kernel's result, rounded once); and whether
    ``linear_pairs`` runs."""
    lib = load()
    return lib is not None and lib.has_bf16_dot


def causal_attention_supports(head_dim: int) -> bool:
    """Whether ``causal_attention`` takes heads of this size: it works on 32 columns of V at a time."""
    return 0 < head_dim <= 256 and head_dim % 32 == 0


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt chunk with nothing cached before it attending to itself, causally.

    query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim] float32 or bfloat16
    (head_dim a multiple of 32 up to 256, see ``causal_attention_supports``; num_heads a multiple of num_kv_heads).
    Returns like query."""
    kernel = _kernel("causal_attention", query, key, value)
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert causal_attention_supports(head_dim) and num_heads % num_kv_heads == 0, \
        "head_dim a multiple of 32 up to 256, whole groups of query heads"
    out = torch.empty_like(query)
    kernel(query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), num_tokens,
                             num_heads, num_kv_heads, head_dim, scale, torch.get_num_threads())
    return out


def decode_attention_supports(head_dim: int) -> bool:
    """Whether ``paged_decode_attention`` takes heads of this size: it reads keys 16 floats at a time."""
    return 0 < head_dim <= 256 and head_dim % 16 == 0


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One query token per row against its paged context, read in place.

    query [num_rows, num_heads, head_dim]; caches [num_kv_heads, num_blocks, block_size, head_dim], all float32 or
    all bfloat16 (head_dim a multiple of 16 up to 256, see ``decode_attention_supports``); block_tables [num_rows,
    max_blocks] int64; seq_lens [num_rows] int64 (>= 1). ``window``: each row sees its last ``window`` keys (no
    block before the window's first is read); ``softcap``: scores capped to ``cap * tanh(score / cap)``. Returns
    like query.
    """
    kernel = _kernel("paged_decode_attention", query, k_cache, v_cache)
    _check_index(block_tables, seq_lens)
    query = query.contiguous()
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    assert num_heads // num_kv_heads <= 64, "at most 64 query heads per kv head"
    assert decode_attention_supports(head_dim), "head_dim a multiple of 16 up to 256"
    out = torch.empty_like(query)
    kernel(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        seq_lens.data_ptr(), out.data_ptr(), num_rows, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
        scale, torch.get_num_threads(), window or 0, softcap or 0.0)
    return out


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] (last dim contiguous) into head-major caches
    [num_kv_heads, num_blocks, block_size, head_dim] at ``slots`` [num_tokens] int64 (block * block_size + offset)."""
    kernel = _kernel("store_kv", key, value, k_cache, v_cache)
    _check_index(slots)
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    slots = slots.contiguous()
    num_tokens, num_kv_heads, head_dim = key.shape
    _, num_blocks, block_size, _ = k_cache.shape
    kernel(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                        num_tokens, num_kv_heads, head_dim, num_blocks, block_size, key.stride(0), key.stride(1),
                        value.stride(0), value.stride(1), torch.get_num_threads())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` [tokens, hidden]; with ``residual``, of ``x + residual``, which is also written back
    into ``residual`` (it is the next residual stream). Under bfloat16 ``x`` and ``weight`` the residual may be
    float32: the stream then keeps its sums unrounded."""
    if residual is not None and residual.dtype is torch.float32 and x.dtype is torch.bfloat16:
        _kernel("rms_norm", x, weight)
        assert residual.is_cpu, "the CPU kernels take CPU tensors"
        kernel = _lib().rms_norm_bf16_f32res
    else:
        kernel = _kernel("rms_norm", x, weight, *([residual] if residual is not None else []))
    assert x.stride(1) == 1 and weight.is_contiguous()
    if residual is not None:
        assert residual.stride(1) == 1
    num_tokens, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    kernel(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                        out.data_ptr(), num_tokens, hidden, x.stride(0), residual.stride(0) if residual is not None else 0,
                        out.stride(0), eps, torch.get_num_threads())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up the two halves of each row of ``gate_up`` [tokens, 2 * width]."""
    kernel = _kernel("silu_and_mul", gate_up)
    assert gate_up.stride(1) == 1
    num_tokens, double = gate_up.shape
    out = torch.empty((num_tokens, double // 2), dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), out.data_ptr(), num_tokens, double // 2, gate_up.stride(0),
                            torch.get_num_threads())
    return out


def pack_experts(weights: torch.Tensor) -> torch.Tensor:
    """Stacked expert weights [experts, out, in] bfloat16, each packed by ``pack_linear_pairs``: [experts, ...]."""
    return torch.stack([pack_linear_pairs(weight) for weight in weights])


def moe_experts(rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
                inter: int) -> torch.Tensor:
    """A mixture-of-experts layer's experts (``csrc/moe_experts.h``, on AVX-512 BF16 only): ``rows`` [pairs, hidden]
    bfloat16 grouped by expert, ``counts[e]`` of them expert e's; ``gate_up`` and ``down`` the stacked weights
    [experts, 2 x inter, hidden] and [experts, hidden, inter] packed by ``pack_experts``. Returns [pairs, hidden]:
    each row through its expert's SiLU MLP, by the dense MLP's kernels."""
    assert bf16_dot_products(), "moe_experts needs a build with AVX-512 BF16 (bf16_dot_products())"
    assert rows.dtype is gate_up.dtype is down.dtype is torch.bfloat16 and rows.is_contiguous()
    offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    scratch = torch.empty((rows.shape[0], 2 * inter), dtype=rows.dtype)
    act = torch.empty((rows.shape[0], inter), dtype=rows.dtype)
    out = torch.empty_like(rows)
    _lib().moe_experts_bf16(rows.data_ptr(), offsets.data_ptr(), gate_up.shape[0], gate_up.data_ptr(),
                            gate_up[0].numel(), down.data_ptr(), down[0].numel(), scratch.data_ptr(), act.data_ptr(),
                            out.data_ptr(), rows.shape[1], inter, torch.get_num_threads())
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] (last dim contiguous), float32 or bfloat16; cos/sin float32 [tokens, 1,
    head_dim / 2]."""
    kernel = _kernel("rope", x)
    _check_tables(cos, sin)
    assert x.stride(2) == 1
    num_tokens, num_heads, head_dim = x.shape
    assert cos.numel() == sin.numel() == num_tokens * (head_dim // 2), "cos/sin: one row of head_dim / 2 per token"
    if not (cos.is_contiguous() and sin.is_contiguous()):  # (the model's tables are: read as [tokens, head_dim / 2])
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype)
    kernel(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), num_tokens, num_heads, head_dim,
                    x.stride(0), x.stride(1), torch.get_num_threads())
    return out


LINEAR_COLS = 64  # output columns per block of a packed weight (the kernel's LINEAR_COLS)


def linear_max_rows() -> int:
    """Up to how many rows ``linear`` should take a matmul on this build (0: the kernels are not built, or the CPU
    has no FMA instructions)."""
    lib = load()
    return lib.linear_max_rows() if lib is not None else 0


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (float32 or bfloat16) in ``linear``'s layout: [ceil(out / 64), in, 64], the columns past
    ``out`` zero."""
    _kernel("linear", weight)
    n, k = weight.shape
    blocks = F.pad(weight.detach(), (0, 0, 0, -n % LINEAR_COLS)).reshape(-1, LINEAR_COLS, k)  # [block, column, in]
    return blocks.transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x`` [rows, in] times the weight ``pack_linear`` packed, plus ``bias``: [rows, out]. Bit for bit what
    oneDNN's packed matmul gives (one thread) for 2 outputs or more, ``in`` up to 1,024, and a lone row at any ``in``
    (see the kernel and tests/kernels/test_cpu_linear.py), in float32; in bfloat16 the products and sums are float32
    and the result is rounded once."""
    kernel = _kernel("linear", x, packed)
    if x.stride(1) != 1:  # (the model's activations are; a transposed view is copied once)
        x = x.contiguous()
    assert packed.shape[1] == x.shape[1], "x's width must be the packed weight's in_features"
    assert 0 < out_features <= packed.shape[0] * LINEAR_COLS, "out_features: more than the packed weight holds"
    if bias is not None:
        assert bias.dtype is x.dtype and bias.is_cpu, "bias: the dtype of x"
        assert bias.shape == (out_features,) and bias.is_contiguous(), "bias: [out_features], contiguous"
    num_rows, k = x.shape
    out = torch.empty((num_rows, out_features), dtype=x.dtype)
    kernel(x.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(),
                      num_rows, out_features, k, x.stride(0), torch.get_num_threads())
    return out


PAIR_COLS = 16  # output columns per block of a pair-packed weight (the kernel's)


def pack_linear_pairs(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] bfloat16 in ``linear_pairs``' layout: [ceil(out / 16), ceil(in / 2), 16, 2], each
    16 columns' weights for two consecutive inputs side by side, zero past ``out`` and ``in``."""
    assert weight.dtype is torch.bfloat16 and weight.is_cpu, "pack_linear_pairs takes a bfloat16 CPU weight"
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, k % 2, 0, -n % PAIR_COLS))
    return padded.reshape(-1, PAIR_COLS, (k + 1) // 2, 2).transpose(1, 2).contiguous()


def linear_pairs(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x`` [rows, in] bfloat16 times the weight ``pack_linear_pairs`` packed, plus ``bias``: [rows, out]
    ``out_dtype`` (bfloat16: rounded once; float32: the sums as they are), on AVX-512 BF16's dot products (only where
    ``bf16_dot_products()``): products and sums in float32."""
    assert bf16_dot_products(), "linear_pairs needs a build with AVX-512 BF16 (bf16_dot_products())"
    assert out_dtype in (torch.bfloat16, torch.float32), "out_dtype: bfloat16 or float32"
    lib = _lib()
    kernel = lib.linear_pairs_bf16 if out_dtype is torch.bfloat16 else lib.linear_pairs_bf16_f32
    assert x.dtype is packed.dtype is torch.bfloat16 and x.is_cpu and packed.is_cpu, \
        "linear_pairs takes bfloat16 CPU tensors"
    if x.stride(1) != 1:
        x = x.contiguous()
    assert packed.shape[1] == (x.shape[1] + 1) // 2 and packed.shape[2:] == (PAIR_COLS, 2), "x's width: the packed in"
    assert 0 < out_features <= packed.shape[0] * PAIR_COLS, "out_features: more than the packed weight holds"
    if bias is not None:
        assert bias.dtype is x.dtype and bias.is_cpu and bias.shape == (out_features,) and bias.is_contiguous()
    num_rows, k = x.shape
    out = torch.empty((num_rows, out_features), dtype=out_dtype)
    kernel(x.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(),
           num_rows, out_features, k, x.stride(0), torch.get_num_threads())
    return out


LINEAR_FORMATS = {"bf16_pairs": 0, "q4": 1, "q8": 2}  # the C++ QuantFormat


class LinearWeight(ctypes.Structure):
    """One linear for ``decode_layers`` (the C++ ``LinearWeight``): its packed weight (``pack_linear_pairs``, or a
    ``kernels.quantized`` q4/q8 weight), its bias or None, and which of those ``format`` (``LINEAR_FORMATS``) is."""

    _fields_ = [("data", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("format", ctypes.c_int64)]


class DecodeLayer(ctypes.Structure):
    """One layer's pointers for ``decode_layers`` (the C++ ``DecodeLayer``): the norms' weights, the four linears,
    the layer's K and V caches."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("qkv", LinearWeight), ("o", LinearWeight),
                ("post_norm", ctypes.c_void_p), ("gate_up", LinearWeight), ("down", LinearWeight),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """The model's sizes ``decode_layers`` needs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


def decode_layers(layers: ctypes.Array, shape: DecodeShape, x: torch.Tensor, residual: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """A decode step's decoder layers, in place: ``x`` [rows, hidden] bfloat16, the embeddings in and the last
    layer's MLP output out; ``residual`` [rows, hidden] float32, zeros in and the residual stream before the last
    MLP out (the caller adds the two). ``layers``: a ``DecodeLayer`` array whose caches hold ``num_blocks`` blocks
    of ``block_size``; cos/sin [rows, head_dim / 2] float32; ``slots``, ``block_tables``, ``seq_lens`` int64 as
    ``store_kv`` and ``paged_decode_attention`` take them. Only where ``bf16_dot_products()``."""
    assert bf16_dot_products(), "decode_layers needs a build with AVX-512 BF16 (bf16_dot_products())"
    assert x.dtype is torch.bfloat16 and residual.dtype is torch.float32 and x.shape == residual.shape
    assert x.is_contiguous() and residual.is_contiguous() and x.is_cpu and residual.is_cpu
    assert cos.dtype is sin.dtype is torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    _check_index(slots, block_tables, seq_lens)
    rows, hidden = x.shape
    assert slots.shape == seq_lens.shape == (rows,) and block_tables.shape[0] == rows
    assert cos.numel() == sin.numel() == rows * (shape.head_dim // 2)
    assert slots.is_contiguous() and block_tables.is_contiguous() and seq_lens.is_contiguous()
    _lib().decode_layers_bf16(
        ctypes.addressof(layers), len(layers), x.data_ptr(), residual.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        slots.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), rows, hidden,
        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate, num_blocks, block_size, shape.eps,
        shape.scale, torch.get_num_threads())
