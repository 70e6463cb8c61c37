"""Our server and llama.cpp's ``llama-server``, side by side, through vLLM's own benchmark client (``vllm bench serve``,
unmodified): ``benchmarks.peers.serve_vs_vllm``'s flow (its functions, imported) with llama.cpp as the peer (issue 48).

Both serve ``--model``'s GGUF file (by default the packaged ``smollm2-135m-instruct``: Q4_1, its embedding Q8_0)
under the same served model name, four ways:

  * ``ours``: our server on the file as it is, kept quantized (engine arg ``quantization: auto``: GGUF
    Q4_0/Q4_1/Q4_K/Q8_0 tensors stay quantized), the rest in ``--dtype`` (default bfloat16);
  * ``ours-bf16``: our server on the dequantized model (``quantization: none``), bfloat16;
  * ``llamacpp``: ``llama-server`` on the same file;
  * ``llamacpp-bf16``: ``llama-server`` on a BF16 file of the same weights, made once with
    ``llama-quantize --allow-requantize IN.gguf OUT.gguf BF16`` and kept in the benchmark cache (``--cache-dir``,
    ``$INFLIGHT_BENCH_CACHE`` or ``~/.cache/inflight/benchmarks``), reused while the source file is unchanged.

Ours is serve_vs_vllm's (``configs/bench-vs-vllm.yaml`` as ``make run`` starts it: 8,000 tokens of KV, 64 batch slots,
one compute thread on CPU 0, the API on :8000). llama.cpp at its best on this machine (docs: the field notes), as
the issue fixes it::

    llama-server -m FILE.gguf --host 127.0.0.1 --port 8001 -a SERVED_NAME -np 64 -kvu -c 65536 -t 1 -tb 1

(64 slots sharing one unified KV cache of 65,536 tokens: at ``-c 8192`` it fails most of 64 concurrent requests with
HTTP 500; one thread for generation and one for prompts). The binary: ``--llamacpp-bin``, ``$INFLIGHT_LLAMACPP_BIN``
or ``.peer-llamacpp/build/bin/llama-server`` (``make peer-llamacpp`` builds it and ``llama-quantize`` beside it).
One server at a time, alternating, each started afresh for its turn; per turn, with ``vllm bench serve`` (random
dataset, prompts of 50-800 tokens, outputs of 20-200 with ``ignore_eos``, greedy; the tokenizer from the model's
Hugging Face export, the client on the CPUs other than 0), as serve_vs_vllm:

  * a warm-up of 8 requests (other prompts than the measured ones), not counted;
  * ``--num-prompts`` requests sent at once, at most ``--concurrency`` in flight;
  * ``--one-stream-prompts`` requests one after another (TTFT and TPOT at one stream).

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.peers.serve_vs_llamacpp --rounds 2 --json results.json
    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.peers.serve_vs_llamacpp \\
        --systems ours,llamacpp,ours-bf16,llamacpp-bf16 --rounds 2 --json results.json

The client runs under the peer virtualenv's Python (``--vllm-python``, ``$INFLIGHT_VLLM_PYTHON`` or ``.venv-vllm``
from ``make peer-venv``). Printed and written (``--json``): per system and round, output tok/s at ``--concurrency``,
failed requests, one-stream TTFT p50 and TPOT p50; the ratios ours / llamacpp and ours-bf16 / llamacpp-bf16 of those
(means over rounds); and the targets of issue 48, met or not: at one stream our TPOT p50 <= 1.0 x llama.cpp's and our
TTFT p50 <= llama.cpp's, at 64 concurrent our output tok/s >= 3 x llama.cpp's, no failed request of ours; the same
TPOT target in bfloat16 on both sides (ours-bf16 against llamacpp-bf16).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import yaml

from benchmarks.common.models import BenchModel, add_model_arg
from benchmarks.common.report import write_json
from benchmarks.peers.serve_vs_vllm import (ROOT, alternate, bench_config, check_turn_args, load_average,
                                            measured_turn, print_table, ratios, start_ours, turn_parser)
from benchmarks.peers.vllm_baseline import resolve_peer_python
from inflight.serve_app.ray_env import API_PORT

LLAMACPP_PORT = 8001
PORTS = {"ours": API_PORT, "ours-bf16": API_PORT, "llamacpp": LLAMACPP_PORT, "llamacpp-bf16": LLAMACPP_PORT}
# our engine's `quantization` per system of ours: auto keeps the file's quantized tensors, none dequantizes them
QUANTIZATION = {"ours": "auto", "ours-bf16": "none"}
# llama-server at its best here (issue 48): 64 slots on one unified KV of 65,536 tokens, one thread (decode, prompt)
LLAMACPP_SETTINGS = ("-np", "64", "-kvu", "-c", "65536", "-t", "1", "-tb", "1")
LLAMACPP_BIN_ENV = "INFLIGHT_LLAMACPP_BIN"
DEFAULT_LLAMACPP_BIN = ROOT / ".peer-llamacpp" / "build" / "bin" / "llama-server"  # make peer-llamacpp
BF16_VERSION = 1  # bump when how the BF16 file is made changes
# the pairs compared, and what: output tok/s at --concurrency, one-stream TTFT p50 and TPOT p50
PAIRS = (("ours", "llamacpp"), ("ours-bf16", "llamacpp-bf16"))
RATIO_KEYS = (("concurrent", "output_throughput"), ("one_stream", "median_ttft_ms"), ("one_stream", "median_tpot_ms"))
# issue 48's targets: (ours, peer, part, key, bound, at most (True) or at least (False) the bound)
TARGETS = (("ours", "llamacpp", "one_stream", "median_tpot_ms", 1.0, True),
           ("ours", "llamacpp", "one_stream", "median_ttft_ms", 1.0, True),
           ("ours", "llamacpp", "concurrent", "output_throughput", 3.0, False),
           ("ours-bf16", "llamacpp-bf16", "one_stream", "median_tpot_ms", 1.0, True))


def resolve_llamacpp_bin(flag: str | None, environ: Mapping[str, str] | None = None,
                         default: Path = DEFAULT_LLAMACPP_BIN) -> Path:
    """``--llamacpp-bin``, else ``$INFLIGHT_LLAMACPP_BIN``, else ``make peer-llamacpp``'s build; a ``ValueError``
    naming where it looked when that is not an executable file."""
    environ = os.environ if environ is None else environ
    if flag:
        path, source = flag, "--llamacpp-bin"
    elif environ.get(LLAMACPP_BIN_ENV):
        path, source = environ[LLAMACPP_BIN_ENV], f"${LLAMACPP_BIN_ENV}"
    else:
        path, source = str(default), "the default"
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ValueError(f"{source}: {path} is not an executable llama-server: run `make peer-llamacpp` or pass "
                         f"--llamacpp-bin PATH (or set ${LLAMACPP_BIN_ENV})")
    return Path(path).resolve()


def llamacpp_server_argv(server_bin: Path | str, gguf_file: Path | str, served_name: str,
                         port: int = LLAMACPP_PORT) -> list[str]:
    return [str(server_bin), "-m", str(gguf_file), "--host", "127.0.0.1", "--port", str(port), "-a", served_name,
            *LLAMACPP_SETTINGS]


def start_llamacpp(server_bin: Path, gguf_file: Path, served_name: str, log) -> subprocess.Popen:
    return subprocess.Popen(llamacpp_server_argv(server_bin, gguf_file, served_name), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def bf16_path(gguf_file: Path, cache_dir: Path) -> Path:
    from inflight.engine.models.gguf_checkpoint import file_key

    return Path(cache_dir) / f"{gguf_file.stem}-BF16-{file_key(gguf_file, BF16_VERSION)[:12]}.gguf"


def quantize_argv(quantize_bin: Path | str, gguf_file: Path | str, out: Path | str) -> list[str]:
    return [str(quantize_bin), "--allow-requantize", str(gguf_file), str(out), "BF16"]


def bf16_gguf(gguf_file: Path, cache_dir: Path, server_bin: Path) -> Path:
    """The BF16 file of ``gguf_file``'s weights, made once by the ``llama-quantize`` beside ``server_bin`` (written
    under another name, then renamed: a half-written file is never used)."""
    path = bf16_path(gguf_file, cache_dir)
    if path.exists():
        return path
    quantize_bin = server_bin.with_name("llama-quantize")
    if not os.access(quantize_bin, os.X_OK):
        raise ValueError(f"llamacpp-bf16: no {quantize_bin} beside llama-server (`make peer-llamacpp` builds both)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".gguf", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(quantize_argv(quantize_bin, gguf_file, tmp), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                               f"{done.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def ours_engine_args(system: str) -> dict[str, str]:
    return {"quantization": QUANTIZATION[system]}


def ours_dtype(system: str, dtype: str) -> str:
    """``ours`` computes in ``--dtype``; ``ours-bf16`` in bfloat16 always (the bfloat16 comparison)."""
    return "bfloat16" if system == "ours-bf16" else dtype


def check_ours(systems: list[str], model: BenchModel, dtype: str) -> None:
    """Our configs as serve_app checks them at start (a ``ValueError`` naming the setting): before any server starts,
    not after Ray has (e.g. an engine without ``quantization``)."""
    from inflight.serve_app.config import AppConfig

    for system in (s for s in systems if s in QUANTIZATION):
        config = yaml.safe_load(bench_config(model.engine_model, None, model.served_name, ours_dtype(system, dtype),
                                             ours_engine_args(system)))
        AppConfig.model_validate(config["applications"][0]["args"])


def one_turn(system: str, args, peer_python: str, model: BenchModel, workdir: Path, round_index: int) -> dict:
    def start(log) -> subprocess.Popen:
        if system in QUANTIZATION:
            return start_ours(model, log, dtype=ours_dtype(system, args.dtype), engine_args=ours_engine_args(system))
        return start_llamacpp(args.llamacpp_bin, args.llamacpp_files[system], model.served_name, log)

    return measured_turn(system, PORTS[system], start, args, peer_python, model, workdir, round_index)


def ours_over_llamacpp(turns: list[dict]) -> dict[str, float]:
    """ours / llamacpp and ours-bf16 / llamacpp-bf16 (those that ran): output tok/s, TTFT p50, TPOT p50."""
    return ratios(turns, PAIRS, RATIO_KEYS)


def targets(turns: list[dict]) -> dict[str, bool]:
    """Issue 48's targets, met or not, for the pairs that ran; and no failed request of ours, if ours ran."""
    found = ratios(turns, PAIRS, RATIO_KEYS)
    met = {}
    for ours, peer, part, key, bound, at_most in TARGETS:
        name = f"{ours} / {peer}: {part}.{key}"
        if name in found:
            met[f"{name} {'<=' if at_most else '>='} {bound}"] = (found[name] <= bound if at_most
                                                                   else found[name] >= bound)
    ours_turns = [t for t in turns if t["system"] in QUANTIZATION]
    if ours_turns:
        met["no failed request of ours"] = all(t[part]["failed"] == 0 for t in ours_turns
                                               for part in ("concurrent", "one_stream"))
    return met


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The flags, checked, with ``args.bench_model`` the resolved ``--model`` (a GGUF file's; no export made yet)."""
    parser = turn_parser("benchmarks.peers.serve_vs_llamacpp", __doc__)
    parser.add_argument("--systems", default="ours,llamacpp",
                        help=f"which servers, in the first round's order, of {', '.join(PORTS)}: ours (the file "
                             f"kept quantized, --dtype), ours-bf16 (dequantized, bfloat16), llamacpp (llama-server "
                             f"on the file), llamacpp-bf16 (llama-server on its BF16 requantization)")
    parser.add_argument("--llamacpp-bin", default=None,
                        help=f"llama-server (default ${LLAMACPP_BIN_ENV}, else "
                             f"{DEFAULT_LLAMACPP_BIN.relative_to(ROOT)} from `make peer-llamacpp`); llamacpp-bf16 "
                             f"uses the llama-quantize beside it")
    add_model_arg(parser, what=" both servers serve: a GGUF file (packaged or a path)")
    parser.add_argument("--cache-dir", default=None,
                        help="where the model's Hugging Face export (the client's tokenizer) and the BF16 file go")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="bfloat16",
                        help="ours' dtype (ours-bf16: always bfloat16); auto: what our engine picks here")
    args = parser.parse_args(argv)
    check_turn_args(parser, args, PORTS)
    if args.bench_model.gguf_file is None:
        parser.error(f"--model {args.bench_model.name}: llama-server needs a GGUF file (a packaged model or a .gguf)")
    args.dtype = args.bench_model.run_dtype(args.dtype)
    return parser, args


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    systems, model = args.systems, args.bench_model
    try:
        peer_python = resolve_peer_python(args.vllm_python)
        check_ours(systems, model, args.dtype)
        args.llamacpp_bin = (resolve_llamacpp_bin(args.llamacpp_bin)
                             if any(s not in QUANTIZATION for s in systems) else None)
        model.hf_dir()  # the client's tokenizer: made once, before any server starts
        # llama-server's files, the BF16 one made once, before any server starts
        args.llamacpp_files = {s: model.gguf_file if s == "llamacpp" else
                               bf16_gguf(model.gguf_file, model.cache_dir, args.llamacpp_bin)
                               for s in systems if s not in QUANTIZATION}
    except ValueError as e:
        parser.error(str(e))
    workdir = Path(tempfile.mkdtemp(prefix="serve-vs-llamacpp-"))
    print(f"model {model.name} (ours: {model.engine_model}, ours in {args.dtype}; llama.cpp: "
          f"{', '.join(f'{s} {p}' for s, p in args.llamacpp_files.items()) or 'not run'}; the client's tokenizer: "
          f"{model.hf_dir()}), served as {model.served_name}; load average at start {load_average():.2f}; logs and "
          f"raw results in {workdir}", flush=True)
    turns = alternate(systems, args.rounds, args.concurrency,
                      lambda system, round_index: one_turn(system, args, peer_python, model, workdir, round_index))
    print_table(turns)
    summary = {"model": model.describe(), "dtype": args.dtype, "workdir": str(workdir),
               "llamacpp": {"bin": str(args.llamacpp_bin), "settings": list(LLAMACPP_SETTINGS),
                            "files": {s: str(p) for s, p in args.llamacpp_files.items()}},
               "turns": turns, "ours_over_llamacpp": ours_over_llamacpp(turns), "targets": targets(turns)}
    for key, value in summary["ours_over_llamacpp"].items():
        print(f"{key}: {value:.3f}")
    for name, met in summary["targets"].items():
        print(f"target {name}: {'met' if met else 'NOT met'}")
    if args.json:
        write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
