"""The serving path's own costs, measured on a running server against a profile's engine step costs.

* Per request: one-token completions of a short prompt, one after another; what each takes beyond the engine's
  predicted prompt step is the fixed cost of HTTP, tokenizing and the router's hop (``ServingCosts.request_s``).
* The serving processes' share of the machine's cores (``serving_cores``, machine.py): with two replicas or
  more, a long prompt's time to its only token on an idle server against the same while every other replica
  decodes a stream (all engines in a step at once), in pairs, the ratios' median. While the engines' threads
  alone fill the cores, the slowdown says how much more the serving processes want: ``stretch x cores - engines
  x threads``. With fewer threads than cores, or one replica, no slowdown shows and 0 is recorded. The probe
  must run on the server's machine, whose cores are the profile's.
* Per streamed token: 1 and then 8 streams per replica at once (the server's /stats says how many replicas it has;
  the router spreads the streams); the gap between two of a stream's tokens beyond the engine's predicted decode
  step (stretched as every engine is busy), per stream in the step, is what each message adds to a step
  (``message_s``: the replica's work per message, on the cores the engine uses).

Tried and left out (2026-12-07, docs/benchmarks.md "Issue 44"): a factor on every step and one on prompt work
fitted from these probes on an idle server (they came out near 1: an idle server computes as fast as the engine
alone), and a step factor calibrated by simulating a timed burst through the server (0.88). What they missed was
the sharing: under load both replicas' engines are busy at once and the serving processes' 0.2-0.3 of a core
comes out of theirs.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inflight.serve_app.sim.machine import MachineShare
from inflight.serve_app.sim.trace import synthetic_tokens

if TYPE_CHECKING:
    from inflight.serve_app.sim.profile import Profile


@dataclass(frozen=True)
class ServingCosts:
    """The serving path's costs around the engine: the latency before a request reaches it, the time a step
    takes longer for each token it streams out, and the cores the serving processes keep busy on the engines'
    machine."""

    request_s: float = 0.0
    message_s: float = 0.0
    serving_cores: float = 0.0


PROMPT_TOKENS = 32
LONG_PROMPT_TOKENS = 512
STREAM_TOKENS = 48
STREAMS_PER_REPLICA = (1, 8)
SINGLE_REQUESTS = 12
LONG_REQUESTS = 8


def measure_serving(url: str, profile: "Profile") -> ServingCosts:
    """The serving costs of the server at ``url``, which serves ``profile``'s model with its engine arguments on
    this machine."""
    import httpx

    costs, vocab_size = profile.cost_model, profile.engine["vocab_size"]
    long_prompt = max(PROMPT_TOKENS, min(LONG_PROMPT_TOKENS, profile.engine["max_model_len"] - 2))

    base = url.rstrip("/")
    with httpx.Client(timeout=120.0) as client:
        try:
            models = client.get(f"{base}/v1/models").raise_for_status().json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            raise ValueError(f"--serving-url {url}: no OpenAI models list there ({e})") from None
        model = models[0]["id"]
        try:
            replicas = max(1, len(client.get(f"{base}/stats").raise_for_status().json()["replicas"]))
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            replicas = 1

        def body(index: int, max_tokens: int, stream: bool, prompt_tokens: int = PROMPT_TOKENS) -> dict:
            return {"model": model, "prompt": synthetic_tokens(f"serving:{index}", prompt_tokens, vocab_size),
                    "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}

        def latency(index: int, prompt_tokens: int = PROMPT_TOKENS) -> float:
            started = time.perf_counter()
            client.post(f"{base}/v1/completions", json=body(index, 1, False, prompt_tokens)).raise_for_status()
            return time.perf_counter() - started

        client.post(f"{base}/v1/completions", json=body(-1, 4, False)).raise_for_status()  # warm-up
        request_s = max(0.0, statistics.median(latency(i) for i in range(SINGLE_REQUESTS))
                        - costs.step_seconds([PROMPT_TOKENS], [0], [True]))
        share = machine_share(profile)
        serving_cores = 0.0
        if replicas > 1 and share is not None:
            longest = profile.engine["max_model_len"] - PROMPT_TOKENS - 1  # the busy streams outlast each probe
            ratios = []  # in pairs, alone then shared, so that the machine's drift over the probe cancels
            for i in range(LONG_REQUESTS):
                alone = latency(100 + i, long_prompt) - request_s
                with _BusyStreams(base, [body(200 + 10 * i + j, longest, True) for j in range(replicas - 1)]) as busy:
                    shared = latency(300 + i, long_prompt) - request_s
                    if busy.all_streaming():
                        ratios.append(shared / alone)
            if ratios:
                serving_cores = serving_cores_from(statistics.median(ratios), replicas, share)
    stretch = MachineShare(share.cores, share.engine_threads, serving_cores).stretch(replicas) if share else 1.0
    excess = []  # per load: (streams in a replica's step, the median gap beyond the engine's predicted step)
    for streams in STREAMS_PER_REPLICA:
        bodies = [body(1000 * streams + i, STREAM_TOKENS, True) for i in range(streams * replicas)]
        context = PROMPT_TOKENS + STREAM_TOKENS // 2
        predicted = costs.step_seconds([1] * streams, [context] * streams, [True] * streams, rebuilt=False) * stretch
        excess.append((streams, statistics.median(_stream_gaps(base, bodies)) - predicted))
    return ServingCosts(request_s, per_message_cost(excess), serving_cores)


def machine_share(profile: "Profile") -> MachineShare | None:
    """What a machine of ``profile``'s shares among its replicas' engines and the serving processes: its CPUs, each
    engine's compute threads while it steps, the serving processes' cores (``profile.serving``). None where the
    engine computes on another device (a GPU's replica has it to itself) or the profile does not say its cores."""
    cores = profile.machine.get("cpu_count")
    if profile.engine["device"] != "cpu" or not cores:
        return None
    threads = profile.machine.get("torch_threads") or cores
    return MachineShare(float(cores), float(threads), profile.serving.serving_cores)


def serving_cores_from(ratio: float, busy_engines: int, share: MachineShare) -> float:
    """The serving processes' cores for which a step takes ``ratio`` x as long with ``busy_engines`` engines
    stepping at once as with its own engine alone (``MachineShare.stretch``: ratio = stretch(n) / stretch(1)), at
    most the machine's cores; 0 where the engines alone leave a core free (no slowdown can show) or none shows."""
    cores, threads = share.cores, share.engine_threads
    engines = busy_engines * threads
    if engines < cores or ratio <= 1.0:
        return 0.0
    room = cores - threads  # what one engine alone leaves the serving processes before it slows
    unslowed_alone = ratio * cores - engines  # the answer if one engine alone ran at full speed
    if 0.0 <= unslowed_alone <= room:
        return unslowed_alone
    slowed_alone = (engines - ratio * threads) / (ratio - 1.0)  # the answer if it did not
    return min(cores, slowed_alone) if slowed_alone >= room else 0.0


def per_message_cost(excess: list[tuple[int, float]]) -> float:
    """The least-squares cost per message of (streams, seconds beyond the predicted step) pairs, not below 0."""
    return max(0.0, sum(n * e for n, e in excess) / sum(n * n for n, _ in excess))


class _BusyStreams:
    """Streams kept decoding (each replica but one busy, as the router spreads them) until the block ends; then
    closed, which aborts them."""

    def __init__(self, base: str, bodies: list[dict], ready_timeout_s: float = 300.0) -> None:
        self.base, self.bodies, self.ready_timeout_s = base, bodies, ready_timeout_s
        self._stop = threading.Event()
        self._started = [threading.Event() for _ in bodies]
        self._ended = [threading.Event() for _ in bodies]
        self._threads = [threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(len(bodies))]

    def __enter__(self) -> "_BusyStreams":
        for thread, started in zip(self._threads, self._started):
            thread.start()
            if not started.wait(self.ready_timeout_s):  # one at a time: the router sees each before the next
                self.__exit__(None, None, None)
                raise ValueError("--serving-url: a stream kept busy for the probe brought no token")
        return self

    def all_streaming(self) -> bool:
        return not any(ended.is_set() for ended in self._ended)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _stream(self, index: int) -> None:
        import httpx

        try:
            with httpx.Client(timeout=300.0) as client, client.stream("POST", f"{self.base}/v1/completions",
                                                                       json=self.bodies[index]) as response:
                for _ in response.iter_bytes():  # not parsed: the probe's own CPU is not the server's
                    self._started[index].set()
                    if self._stop.is_set():
                        return  # leaving the block closes the connection: the server aborts the request
        except httpx.HTTPError:
            pass
        finally:
            self._ended[index].set()
            self._started[index].set()


def _stream_gaps(base: str, bodies: list[dict]) -> list[float]:
    """The gaps between consecutive tokens of each stream, the streams run at once (the first two tokens' gap left
    out: the others' prompts may still be computing)."""
    import httpx

    gaps: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def one(body: dict) -> None:
        try:
            times = []
            with httpx.Client(timeout=300.0) as client, client.stream("POST", f"{base}/v1/completions",
                                                                       json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if json.loads(line[6:]).get("choices"):
                            times.append(time.perf_counter())
            with lock:
                gaps.extend(b - a for a, b in zip(times[2:], times[3:]))
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=one, args=(b,)) for b in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise ValueError(f"--serving-url: a streamed request failed ({errors[0]})")
    if not gaps:
        raise ValueError("--serving-url: the streams brought too few tokens to time")
    return gaps
