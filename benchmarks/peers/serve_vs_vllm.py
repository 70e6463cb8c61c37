"""Our server and vLLM's, side by side, through vLLM's own benchmark client (`vllm bench serve`, unmodified).

Both serve ``--model`` (``benchmarks.common.models``; by default the real SmolLM2-135M-Instruct, ``bench-random`` for the
random toy checkpoint of ``benchmarks.common.workloads``) under the same served model name, ours loading it as it is (a
packaged name, a GGUF file, a checkpoint directory), vLLM the Hugging Face directory of it (a GGUF file's float32
export; ``vllm bench serve`` takes its tokenizer from there too), with the same sizes: 8,000 tokens of KV, 64 batch
slots, 2,048 tokens per step, ``max_model_len`` 2,048, float32, one compute thread each (but the ``-all-cpus``
systems, below). Ours is ``configs/bench-vs-vllm.yaml`` started as ``make run`` starts a config
(``scripts/serve.sh``): its engine process on CPU 0, Ray's processes on the others, the API on :8000 served by the
router replica itself (Serve's direct ingress, ``serve_app/ray_env.py``). vLLM's is
``benchmarks/peers/vllm_serve.py`` (port 8001), twice: with its defaults (``vllm``: its compute thread bound by
``VLLM_CPU_OMP_THREADS_BIND=auto``), and placed as ours (``vllm-isolated``: compute thread on CPU 0, the server
under ``taskset`` on the others). ``ours-proxy`` is the same server of ours with the client on Serve's proxy (the
config's :8100), the hop a cluster's entry point adds. ``ours-all-cpus`` and ``vllm-all-cpus`` compute with one
thread per CPU instead (ours: ``num_threads`` as many, no ``engine_cpus``, so Ray shares every CPU with it; vLLM:
``VLLM_CPU_OMP_THREADS_BIND`` lists them all): under 64 concurrent requests the serving processes use a fraction of
the second core, which a second compute thread can take (on the 2-core benchmark machine 12-15% more output
tokens/s for ours, -2% to +20% for vLLM, in the same runs, on the toy model: docs/benchmarks-history.md). The
client always runs on the CPUs other than 0. One server at a time, alternating, each started afresh for its turn; per turn, with ``vllm bench
serve`` (random dataset, prompts of 50-800 tokens, outputs of 20-200 with ``ignore_eos``, greedy):

  * a warm-up of 8 requests (other prompts than the measured ones), not counted;
  * ``--num-prompts`` requests sent at once, at most ``--concurrency`` in flight;
  * ``--one-stream-prompts`` requests one after another (TTFT and TPOT at one stream).

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.peers.serve_vs_vllm --rounds 2 --json results.json
    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.peers.serve_vs_vllm --model bench-random --systems ours,vllm

The client runs under the peer virtualenv's Python (``--vllm-python``, ``$INFLIGHT_VLLM_PYTHON`` or
``.venv-vllm`` from ``make peer-venv``) through ``benchmarks/peers/vllm_cli.py``. Targets (issue 13): at 64
concurrent our output tok/s >= vLLM's and our mean end-to-end latency <= vLLM's; at one stream our TTFT p50
<= 1.1 x vLLM's and our TPOT p50 <= vLLM's; no failed request.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.common.models import BenchModel, add_model_arg, model_from_args
from benchmarks.common.report import write_json
from benchmarks.common.workloads import MODEL_NAME, add_sampling_args, check_sampling_args
from benchmarks.peers.preload import with_peer_preload
from benchmarks.peers.vllm_baseline import resolve_peer_python
from inflight.engine.cpu_list import format_cpu_list
from inflight.serve_app.cpu_plan import cpus_left
from inflight.serve_app.ray_env import API_PORT, LOCAL_PROXY_PORT

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "peers"
# ours: the API port of `make run` (the router itself); ours-proxy: the same server through Serve's proxy
PORTS = {"ours": API_PORT, "ours-proxy": LOCAL_PROXY_PORT, "ours-all-cpus": API_PORT,
         "vllm": 8001, "vllm-isolated": 8001, "vllm-all-cpus": 8001}
ENGINE_CPU = 0  # ours: configs/bench-vs-vllm.yaml's engine_cpus; vLLM isolated: its compute thread's core


def all_cpus() -> set[int]:
    return set(os.sched_getaffinity(0))


def other_cpus() -> str:
    """Every CPU but the engines' (for the client, Ray, and vLLM's API server when isolated)."""
    rest = cpus_left({ENGINE_CPU})
    if rest is None:
        raise SystemExit("serve_vs_vllm needs at least 2 CPUs: the engines' and the rest")
    return format_cpu_list(rest)
# vLLM's random dataset draws lengths uniformly in [len x (1 - ratio), len x (1 + ratio)]
INPUT_LEN, OUTPUT_LEN, RANGE_RATIO = 425, 110, '{"input": 0.8824, "output": 0.8182}'  # 50-800, 20-200
METRICS = ("completed", "failed", "output_throughput", "mean_e2el_ms", "median_e2el_ms", "median_ttft_ms",
           "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "duration")


# A decode step of this few rows gains less from a second thread than it loses waiting for a core the router and
# the replica are using on its stream's tokens (one stream: 4.7 ms per token on two threads, 3.4 on one pinned).
ONE_THREAD_MAX_TOKENS = 4


def bench_config(checkpoint: Path | str, num_threads: int | None = None, served_name: str = MODEL_NAME,
                 dtype: str | None = None, engine_args: dict[str, Any] | None = None) -> str:
    """configs/bench-vs-vllm.yaml for ``checkpoint`` (what our engine loads: a path or a packaged model's name)
    served as ``served_name`` (in ``dtype``, when given: else the file's float32; with ``engine_args``' other
    settings, e.g. serve_vs_llamacpp's ``quantization``); with ``num_threads``, its engine computes with that many
    threads on no CPUs of its own (no ``engine_cpus``: Ray's processes share every CPU with it), but for steps of at
    most ``ONE_THREAD_MAX_TOKENS`` tokens (a decode of a few streams), which run on one."""
    text = ((ROOT / "configs" / "bench-vs-vllm.yaml").read_text().replace("@BENCH_CHECKPOINT@", str(checkpoint))
            .replace("@SERVED_MODEL_NAME@", served_name))
    if num_threads is None and dtype is None and not engine_args:
        return text
    config = yaml.safe_load(text)
    app = config["applications"][0]["args"]
    app["engine_args"].update(engine_args or {})
    if dtype is not None:
        app["engine_args"]["dtype"] = dtype
    if num_threads is not None:
        app["engine_args"]["num_threads"] = num_threads
        app["engine_args"]["one_thread_max_tokens"] = ONE_THREAD_MAX_TOKENS
        del app["engine_cpus"]
    return yaml.safe_dump(config, sort_keys=False)


def start_ours(model: BenchModel, log, num_threads: int | None = None, dtype: str | None = None,
               engine_args: dict[str, Any] | None = None) -> subprocess.Popen:
    config = Path(tempfile.mkstemp(prefix="bench-vs-vllm-", suffix=".yaml")[1])
    config.write_text(bench_config(model.engine_model, num_threads, model.served_name, dtype, engine_args))
    # serve.sh sets Serve's environment as make run does (serve_app.ray_env --local) and RAY_AUTH_MODE
    return subprocess.Popen([str(ROOT / "scripts" / "serve.sh"), str(config)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def start_vllm(peer_python: str, threads_bind: str, isolated: bool, log, model: BenchModel,
               dtype: str = "float32") -> subprocess.Popen:
    """vLLM's server on ``model``'s Hugging Face directory under its served name, its compute threads bound by
    ``threads_bind``; ``isolated``: as ours runs, its compute thread on the engine's CPU and everything else (its
    API server, its engine process's other threads) on the other CPUs."""
    return subprocess.Popen(vllm_server_argv(peer_python, threads_bind, isolated, model, dtype), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, env=with_peer_preload(peer_python))


def vllm_server_argv(peer_python: str, threads_bind: str, isolated: bool, model: BenchModel,
                     dtype: str = "float32") -> list[str]:
    argv = [peer_python, str(PEERS / "vllm_serve.py"), "--model", str(model.hf_dir()),
            "--served-model-name", model.served_name, "--dtype", dtype,
            "--threads-bind", str(ENGINE_CPU) if isolated else threads_bind]
    return ["taskset", "-c", other_cpus(), *argv] if isolated else argv


def wait_ready(port: int, server: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server on :{port} exited ({server.returncode}) before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the server on :{port} was not ready in {timeout_s:.0f} s")


def stop(server: subprocess.Popen) -> None:
    """Ctrl-C to the server's process group (serve.sh then stops its Ray), then force."""
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    if server.args[0].endswith("serve.sh"):  # a killed serve.sh leaves its Ray behind
        subprocess.run([str(ROOT / ".venv" / "bin" / "ray"), "stop", "--force"], capture_output=True)
    time.sleep(3.0)  # ports and cores free again


def bench(peer_python: str, port: int, model: BenchModel, num_prompts: int, concurrency: int, seed: int,
          out: Path, temperature: float = 0.0, top_p: float = 1.0) -> dict[str, Any]:
    argv = client_argv(peer_python, port, model, num_prompts, concurrency, seed, out, temperature, top_p)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    return {key: result.get(key) for key in METRICS} | {"errors": [e for e in result.get("errors", []) if e][:3]}


def client_argv(peer_python: str, port: int, model: BenchModel, num_prompts: int, concurrency: int, seed: int,
                out: Path, temperature: float = 0.0, top_p: float = 1.0) -> list[str]:
    """`vllm bench serve`'s command line. The client never runs on the engines' CPU, whichever server it loads; it
    reads the tokenizer from the model's Hugging Face directory and asks for its served name."""
    return ["taskset", "-c", other_cpus(), peer_python, str(PEERS / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
            "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
            "--model", str(model.hf_dir()), "--served-model-name", model.served_name,
            "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--random-range-ratio", RANGE_RATIO, "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos", "--temperature", str(temperature), "--top-p", str(top_p),
            "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
            "--result-filename", out.name]


def load_average() -> float:
    return os.getloadavg()[0]


def one_turn(system: str, args, peer_python: str, model: BenchModel, workdir: Path, round_index: int) -> dict:
    def start(log) -> subprocess.Popen:
        if system.startswith("ours"):
            return start_ours(model, log, len(all_cpus()) if system == "ours-all-cpus" else None, args.dtype)
        threads_bind = format_cpu_list(all_cpus()) if system == "vllm-all-cpus" else args.vllm_threads_bind
        return start_vllm(peer_python, threads_bind, system == "vllm-isolated", log, model, args.dtype)

    return measured_turn(system, PORTS[system], start, args, peer_python, model, workdir, round_index)


def measured_turn(system: str, port: int, start: Callable[[Any], subprocess.Popen], args, peer_python: str,
                  model: BenchModel, workdir: Path, round_index: int) -> dict:
    """One system's turn: ``start(log)`` starts its server (listening on ``port``), then, once it is ready, the
    warm-up, ``args.num_prompts`` at ``args.concurrency`` and ``args.one_stream_prompts`` at one stream through
    ``vllm bench serve``; the server is stopped whatever happens."""
    log = open(workdir / f"{system}-{round_index}.log", "w")
    server = start(log)
    try:
        wait_ready(port, server)
        sampling = {"temperature": args.temperature, "top_p": args.top_p}
        bench(peer_python, port, model, 8, 8, seed=1000 + round_index,
              out=workdir / f"{system}-{round_index}-warm.json", **sampling)
        turn: dict[str, Any] = {"system": system, "round": round_index, "load_start": load_average()}
        turn["concurrent"] = bench(peer_python, port, model, args.num_prompts, args.concurrency, seed=0,
                                   out=workdir / f"{system}-{round_index}-concurrent.json", **sampling)
        turn["one_stream"] = bench(peer_python, port, model, args.one_stream_prompts, 1, seed=2,
                                   out=workdir / f"{system}-{round_index}-one.json", **sampling)
        turn["load_end"] = load_average()
        return turn
    finally:
        stop(server)
        log.close()


RATIO_KEYS = (("concurrent", "output_throughput"), ("concurrent", "mean_e2el_ms"),
              ("one_stream", "median_ttft_ms"), ("one_stream", "median_tpot_ms"))


def ratios(turns: list[dict], pairs: Iterable[tuple[str, str]] | None = None,
           keys: Iterable[tuple[str, str]] = RATIO_KEYS) -> dict[str, float]:
    """Our value over the peer's, from the means over rounds, for each (ours, peer) of ``pairs`` that ran (None:
    every system of ours against every peer's), for each (part, key) of ``keys``."""
    def mean(system: str, part: str, key: str) -> float:
        values = [t[part][key] for t in turns if t["system"] == system]
        return sum(values) / len(values)

    systems = {t["system"] for t in turns}
    peers = sorted(s for s in systems if not s.startswith("ours"))
    if pairs is None:
        pairs = [(ours, peer) for ours in sorted(systems - set(peers)) for peer in peers]
    return {f"{ours} / {peer}: {part}.{key}": mean(ours, part, key) / mean(peer, part, key)
            for ours, peer in pairs if {ours, peer} <= systems for part, key in keys}


def print_table(turns: list[dict]) -> None:
    print(f"{'system':13} {'round':>5} {'part':10} {'ok':>4} {'failed':>6} {'out tok/s':>9} {'e2e mean':>9} "
          f"{'TTFT p50':>9} {'TPOT p50':>9} {'ITL p50':>8} {'load':>11}")
    for turn in turns:
        for part in ("concurrent", "one_stream"):
            r = turn[part]
            print(f"{turn['system']:13} {turn['round']:>5} {part:10} {r['completed']:>4} {r['failed']:>6} "
                  f"{r['output_throughput']:>9.1f} {r['mean_e2el_ms']:>9.0f} {r['median_ttft_ms']:>9.1f} "
                  f"{r['median_tpot_ms']:>9.2f} {r['median_itl_ms']:>8.1f} "
                  f"{turn['load_start']:>5.2f}->{turn['load_end']:<5.2f}")


def turn_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """A serve_vs_* benchmark's parser (``python -m module``, ``doc`` its help), with ``add_turn_args``' flags."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_turn_args(parser)
    return parser


def add_turn_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the rounds and of each turn's requests, the client's Python and --json (what every
    serve_vs_* benchmark takes; ``check_sampling_args`` checks the sampling ones)."""
    parser.add_argument("--rounds", type=int, default=2,
                        help="each round serves every system in turn, the next round in the reverse order")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--one-stream-prompts", type=int, default=16)
    parser.add_argument("--vllm-python", default=None, help="the peer virtualenv's Python (vllm bench serve)")
    add_sampling_args(parser)
    parser.add_argument("--json", default=None)


def alternate(systems: list[str], rounds: int, concurrency: int, turn: Callable[[str, int], dict]) -> list[dict]:
    """``turn(system, round)`` for every system in every round, the odd rounds in the reverse order."""
    turns = []
    for round_index in range(rounds):
        for system in systems if round_index % 2 == 0 else systems[::-1]:
            turns.append(turn(system, round_index))
            print(f"round {round_index} {system}: {turns[-1]['concurrent']['output_throughput']:.1f} tok/s "
                  f"at {concurrency} concurrent", flush=True)
    return turns


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The flags, checked, with ``args.bench_model`` the resolved ``--model`` (its export not made yet)."""
    parser = turn_parser("benchmarks.peers.serve_vs_vllm", __doc__)
    parser.add_argument("--systems", default="ours,ours-all-cpus,vllm,vllm-all-cpus",
                        help="which servers, in the first round's order: ours (make run's API port, the router itself), "
                             "ours-proxy (the same through Serve's proxy), vllm (its defaults, --vllm-threads-bind), "
                             "vllm-isolated (its compute thread alone on CPU 0, as ours, the rest on the other CPUs), "
                             "ours-all-cpus and vllm-all-cpus (a compute thread on every CPU, shared with the rest)")
    parser.add_argument("--vllm-threads-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND (auto: one core)")
    add_model_arg(parser, what=" both servers serve (vLLM: its Hugging Face directory, a GGUF file's export)")
    parser.add_argument("--cache-dir", default=None, help="where the benchmark checkpoint and GGUF exports are built")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="both servers' dtype; auto: what our engine picks for the model here (resolved once)")
    args = parser.parse_args(argv)
    check_turn_args(parser, args, PORTS)
    args.dtype = args.bench_model.run_dtype(args.dtype)
    return parser, args


def check_turn_args(parser: argparse.ArgumentParser, args: argparse.Namespace, known_systems) -> None:
    """What every serve_vs_* benchmark checks once parsed: the sampling flags, ``--systems`` (split, each one of
    ``known_systems``) and ``--model`` (resolved into ``args.bench_model``)."""
    check_sampling_args(parser, args)
    systems = args.systems.split(",")
    if not set(systems) <= set(known_systems):
        parser.error(f"--systems: choose from {', '.join(known_systems)}")
    args.systems = systems
    args.bench_model = model_from_args(parser, args)


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    systems, model = args.systems, args.bench_model
    try:
        peer_python = resolve_peer_python(args.vllm_python)
        model.hf_dir()  # the client's tokenizer and vLLM's checkpoint: made once, before any server starts
    except ValueError as e:
        parser.error(str(e))
    workdir = Path(tempfile.mkdtemp(prefix="serve-vs-vllm-"))
    print(f"model {model.name} (ours: {model.engine_model}; vLLM and the client: {model.hf_dir()}), served as "
          f"{model.served_name}; load average at start {load_average():.2f}; logs and raw results in {workdir}",
          flush=True)
    turns = alternate(systems, args.rounds, args.concurrency,
                      lambda system, round_index: one_turn(system, args, peer_python, model, workdir, round_index))
    print_table(turns)
    summary = {"model": model.describe(), "turns": turns, "workdir": str(workdir)}
    if any(s.startswith("ours") for s in systems) and any(not s.startswith("ours") for s in systems):
        summary["ours_over_vllm"] = ratios(turns)
        for key, value in summary["ours_over_vllm"].items():
            print(f"{key}: {value:.3f}")
    if args.json:
        write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
