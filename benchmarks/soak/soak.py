"""Soak test: a mixed load against a running server for a while, watching for leaks, lost requests and 5xx.

    python -m benchmarks.soak.soak --minutes N --url http://127.0.0.1:8000 [--json out.json] [--png out.png]
        [--kill-replica-every S] [--concurrency C] [--sample-every 10]

The load (``--concurrency`` workers, each picking a scenario at random, and a burst at the start of every phase):
streaming and non-streaming ``/v1/completions`` and ``/v1/chat/completions``, ``/v1/embeddings``, clients that
disconnect mid-stream, aborts (a request cancelled before its answer, which closes the connection), requests
with a short ``timeout`` that run past it, bursts over the router's admission limit, and bad inputs.

Every response is classified:

* ok;
* expected 4xx: any 429, and the 4xx of the deliberate bad inputs;
* client-caused: our own disconnects and aborts, and the deliberate timeouts (504, or a stream's error event with
  code ``timeout``: the deadline the client asked for);
* lost (``--kill-replica-every`` only): a response cut by a replica kill (code ``replica_lost``: a stream's error
  event, or a 503 once the router's retries ran out);
* unexpected: any other 5xx, a connection error, a stream that ends without ``data: [DONE]`` or with an error event
  the client did not cause, a 2xx to a bad input, a 4xx to a good one, a malformed body.

Every ``--sample-every`` seconds: RSS and open file descriptors of each Ray Serve process on this machine (read from
/proc: the proxy ``ray::ProxyActor``, the controller, routers ``ray::ServeReplica:<app>:Router``, replicas
``ray::ServeReplica:<app>:LLMReplica`` and the replicas' engine child processes), keyed by pid and role, and
``GET /stats`` (each replica's running and waiting requests and KV blocks in use). Every ``--pause-every`` seconds
the load stops for up to ``--pause-s`` seconds: every replica must report no running or waiting request and
``kv_blocks_used`` back to 0, and the router ``in_flight`` 0. File descriptors are compared between these quiet
moments (with the load's connections closed) rather than under load, where open sockets come and go. A check
before the load (the baseline) is recorded but not judged. ``--app NAME`` watches (and kills) only that Serve app's
routers and replicas; the proxy and controller are shared by all apps.

The verdict (exit status 0 PASS, 1 FAIL; 2 when the server cannot be reached): per role, RSS growth after the
warm-up (``--warmup-minutes``, default the first 20%) below ``--max-rss-growth-pct`` (``--role-max-rss-growth-pct ROLE=PCT`` for another limit on one role);
fds flat within ``--max-fd-growth``; no 5xx and no unexpected failure; KV idle at every pause; with
``--require-no-loss``, no lost request either. RSS growth is each process's least-squares slope after the warm-up
(the first 20% of its samples, at least 2) times the steady state's length, in % of its RSS at the start of it;
a role's is its worst process's.

``--kill-replica-every S`` (chaos): every S seconds one LLMReplica actor is killed (``ray.kill``, no_restart; Serve
starts a new one). It joins the cluster with ``ray.init(address="auto")``, so it runs on a node of that cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import httpx
import numpy as np

from benchmarks.common.flags import positive_float, positive_int
from benchmarks.common.openai_client import SSEReader
from benchmarks.common.report import load_average, print_table, pyplot, save_figure, write_json
from benchmarks.common.serve_processes import connect_ray, kill_one_replica, sample_processes

# -- outcome categories ------------------------------------------------------------------------------------
OK = "ok"
EXPECTED_4XX = "expected 4xx"  # 429s, and the 4xx that the deliberate bad inputs get
CLIENT = "client-caused"  # our disconnects, aborts and too-short deadlines
LOST = "lost"  # cut by a replica kill (chaos mode only)
UNEXPECTED = "unexpected"
CATEGORIES = (OK, EXPECTED_4XX, CLIENT, LOST, UNEXPECTED)

# Scenario -> weight: how often a worker picks it. Bursts are not among them: one starts with every load phase.
SCENARIOS: dict[str, float] = {
    "completion": 3, "completion_stream": 3, "chat": 2, "chat_stream": 2, "embeddings": 1.5,
    "disconnect": 1, "abort": 1, "timeout": 1, "bad_input": 1,
}
REQUEST_TIMEOUT_S = 60.0  # a request that takes longer has hung: an unexpected failure
WORDS = ("the quick brown fox jumps over a lazy dog while soaking servers leak nothing under steady load "
         "for hours").split()


# -- one request --------------------------------------------------------------------------------------------
@dataclass
class Reply:
    """What the client saw of one request."""

    status: int | None = None  # None: no response (connection error, hang, or we cut it first)
    done: bool = False  # a stream that ended with `data: [DONE]`, or a non-streaming answer read in full
    error_code: str | None = None  # from an error body or a stream's error event
    error_message: str | None = None
    body_ok: bool = True  # a 200's body had what it must (choices, data)
    cut_by_client: bool = False  # we disconnected or aborted before the end
    exception: str | None = None  # a transport error: connection refused/reset, read timeout


@dataclass
class Outcome:
    t: float  # seconds since the start, when it ended
    scenario: str
    category: str
    status: int | None
    detail: str | None = None


def classify(scenario: str, reply: Reply, chaos: bool) -> tuple[str, str | None]:
    """(category, detail) of one request; the order of the rules matters (a 429 beats everything after it)."""
    if reply.cut_by_client:
        return CLIENT, "disconnect" if scenario == "disconnect" else "abort"
    if reply.exception is not None:
        return UNEXPECTED, reply.exception
    status = reply.status
    if status == 429:
        return EXPECTED_4XX, "429"
    if scenario == "bad_input":
        if status is not None and 400 <= status < 500:
            return EXPECTED_4XX, str(status)
        return UNEXPECTED, f"bad input answered {status}"
    if reply.error_code == "replica_lost":
        # Killed replicas are expected to cost requests only in chaos mode; elsewhere it is a crash.
        return (LOST if chaos else UNEXPECTED), f"{status} replica_lost"
    if scenario == "timeout" and (status == 504 or reply.error_code == "timeout"):
        return CLIENT, "deadline"
    if status is None or status >= 400:
        return UNEXPECTED, f"{status} {reply.error_code or ''}: {(reply.error_message or '')[:120]}".strip()
    if reply.error_code is not None or reply.error_message is not None:
        return UNEXPECTED, f"error event {reply.error_code}: {(reply.error_message or '')[:120]}"
    if not reply.done:
        return UNEXPECTED, "stream ended without [DONE]"
    if not reply.body_ok:
        return UNEXPECTED, "malformed body"
    return OK, None


def _error_of(text: str) -> tuple[str | None, str | None]:
    try:
        error = json.loads(text).get("error") or {}
    except (ValueError, AttributeError):
        return None, text[:200]
    return error.get("code"), error.get("message")


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any] | None = None,
               content: bytes | None = None) -> Reply:
    """A non-streaming POST, read in full."""
    try:
        if content is not None:
            response = await client.post(path, content=content, headers={"content-type": "application/json"})
        else:
            response = await client.post(path, json=body)
    except httpx.HTTPError as e:
        return Reply(exception=f"{type(e).__name__}: {e}"[:200])
    reply = Reply(response.status_code, done=True)
    if response.status_code != 200:
        reply.error_code, reply.error_message = _error_of(response.text)
        return reply
    try:
        payload = response.json()
        reply.body_ok = bool(payload.get("data") if path.endswith("embeddings") else payload.get("choices"))
    except ValueError:
        reply.body_ok = False
    return reply


async def post_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                      cut_after_events: int | None = None) -> Reply:
    """A streaming POST read event by event; ``cut_after_events``: close the connection after that many."""
    try:
        async with client.stream("POST", path, json={**body, "stream": True}) as response:
            reply = Reply(response.status_code)
            if response.status_code != 200:
                await response.aread()
                reply.error_code, reply.error_message = _error_of(response.text)
                reply.done = True
                return reply
            events = 0
            sse = SSEReader()
            async for event in sse.events(response.aiter_lines()):
                if "error" in event:
                    error = event["error"] or {}
                    reply.error_code, reply.error_message = error.get("code"), error.get("message") or "error"
                events += 1
                if cut_after_events is not None and events >= cut_after_events:
                    reply.cut_by_client = True  # leaving the `async with` unread closes the connection
                    break
            reply.done, reply.body_ok = sse.done, not sse.num_malformed
            return reply
    except httpx.HTTPError as e:
        return Reply(exception=f"{type(e).__name__}: {e}"[:200])


# -- the load -----------------------------------------------------------------------------------------------
def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))


def bad_inputs(model: str) -> list[tuple[str, dict[str, Any] | bytes]]:
    """Requests every server must refuse with a 4xx (a few of tests/serving/test_bad_input.py's)."""
    msgs = [{"role": "user", "content": "hi"}]
    return [
        ("/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": '),  # malformed JSON
        ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": -1}),
        ("/v1/completions", {"model": model, "prompt": "x", "temperature": "hot"}),
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),  # 404
        ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 10_000_000}),  # past max_model_len
        ("/v1/chat/completions", {"model": model, "messages": []}),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "top_p": 1.5, "stream": True}),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "frobnicate": True}),
        ("/v1/embeddings", {"model": model, "input": ""}),
        ("/v1/embeddings", {"model": model, "input": "x", "dimensions": 8}),
    ]


async def run_scenario(client: httpx.AsyncClient, scenario: str, model: str, rng: random.Random) -> Reply:
    msgs = [{"role": "user", "content": _prompt(rng)}]
    max_tokens = rng.randint(4, 48)
    if scenario == "completion":
        return await post(client, "/v1/completions", {"model": model, "prompt": _prompt(rng), "max_tokens": max_tokens})
    if scenario == "completion_stream":
        return await post_stream(client, "/v1/completions", {"model": model, "prompt": _prompt(rng),
                                                             "max_tokens": max_tokens,
                                                             "stream_options": {"include_usage": True}})
    if scenario == "chat":
        return await post(client, "/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": max_tokens})
    if scenario == "chat_stream":
        return await post_stream(client, "/v1/chat/completions", {"model": model, "messages": msgs,
                                                                  "max_tokens": max_tokens})
    if scenario == "embeddings":
        inputs = [_prompt(rng) for _ in range(rng.randint(1, 4))]
        return await post(client, "/v1/embeddings", {"model": model, "input": inputs})
    if scenario == "disconnect":  # read a few events of a long stream, then hang up
        return await post_stream(client, "/v1/completions",
                                 {"model": model, "prompt": _prompt(rng), "max_tokens": 512, "ignore_eos": True},
                                 cut_after_events=rng.randint(1, 6))
    if scenario == "abort":  # give up on a long answer before it comes: httpx closes the connection
        body = {"model": model, "prompt": _prompt(rng), "max_tokens": 512, "ignore_eos": True}
        call = post_stream(client, "/v1/completions", body) if rng.random() < 0.5 else \
            post(client, "/v1/completions", body)
        try:
            return await asyncio.wait_for(call, timeout=rng.uniform(0.05, 0.5))
        except asyncio.TimeoutError:
            return Reply(cut_by_client=True)
    if scenario == "timeout":  # a deadline far too short for 1024 tokens
        body = {"model": model, "prompt": _prompt(rng), "max_tokens": 1024, "ignore_eos": True,
                "timeout": round(rng.uniform(0.05, 0.3), 3)}
        if rng.random() < 0.5:
            return await post_stream(client, "/v1/completions", body)
        return await post(client, "/v1/completions", body)
    if scenario == "bad_input":
        path, body = rng.choice(bad_inputs(model))
        if isinstance(body, bytes):
            return await post(client, path, content=body)
        if body.get("stream"):
            return await post_stream(client, path, body)
        return await post(client, path, body)
    raise ValueError(f"unknown scenario {scenario!r}")


class Soak:
    """The run's state: outcomes, samples, idle checks and kills, all timed from ``self.start``."""

    def __init__(self, args: argparse.Namespace, model: str, admission_limit: int) -> None:
        self.args = args
        self.model = model
        self.admission_limit = admission_limit
        self.chaos = args.kill_replica_every is not None
        self.start = time.monotonic()
        self.outcomes: list[Outcome] = []
        self.counts: Counter[tuple[str, str]] = Counter()  # (scenario, category) -> requests
        self.statuses: Counter[str] = Counter()
        self.samples: list[dict[str, Any]] = []  # periodic and at idle checks: processes and /stats
        self.idle_checks: list[dict[str, Any]] = []
        self.kills: list[dict[str, Any]] = []
        self.paused = asyncio.Event()  # set while the load is paused: chaos waits rather than kill then
        self.stats_client = httpx.AsyncClient(base_url=args.url, timeout=10.0)

    def now(self) -> float:
        return time.monotonic() - self.start

    def record(self, scenario: str, reply: Reply) -> None:
        category, detail = classify(scenario, reply, self.chaos)
        self.counts[(scenario, category)] += 1
        self.statuses[str(reply.status) if reply.status is not None else "none"] += 1
        # Every request is counted; only the ones that were not plainly ok are kept one by one (a long soak
        # sends millions).
        if category != OK:
            self.outcomes.append(Outcome(round(self.now(), 3), scenario, category, reply.status, detail))

    async def worker(self, client: httpx.AsyncClient, rng: random.Random, until: float) -> None:
        names, weights = list(SCENARIOS), list(SCENARIOS.values())
        while self.now() < until:
            scenario = rng.choices(names, weights)[0]
            try:
                reply = await asyncio.wait_for(run_scenario(client, scenario, self.model, rng), REQUEST_TIMEOUT_S)
            except asyncio.TimeoutError:
                reply = Reply(exception=f"no answer within {REQUEST_TIMEOUT_S:g} s")
            self.record(scenario, reply)

    async def burst(self, rng: random.Random) -> None:
        """More requests at once than the router admits: the excess must get 429s, never 5xx."""
        size = burst_size(self.admission_limit)
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.args.url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            replies = await asyncio.gather(*(post(client, "/v1/completions", {
                "model": self.model, "prompt": _prompt(rng), "max_tokens": 16, "ignore_eos": True})
                for _ in range(size)))
        for reply in replies:
            self.record("burst", reply)

    async def load_phase(self, until: float, phase: int) -> None:
        # A fresh client per phase, closed before the pause: the proxy then holds none of our load's sockets
        # when the fds are counted.
        limits = httpx.Limits(max_connections=self.args.concurrency, max_keepalive_connections=self.args.concurrency)
        async with httpx.AsyncClient(base_url=self.args.url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            rngs = [random.Random(f"{self.args.seed}-{phase}-{i}") for i in range(self.args.concurrency + 1)]
            tasks = [self.worker(client, rng, until) for rng in rngs[1:]]
            await asyncio.gather(self.burst(rngs[0]), *tasks)

    # -- watching --------------------------------------------------------------------------------------
    async def get_stats(self) -> dict[str, Any]:
        try:
            response = await self.stats_client.get("/stats")
            if response.status_code != 200:
                return {"error": f"/stats answered {response.status_code}"}
            return response.json()
        except (httpx.HTTPError, ValueError) as e:
            return {"error": f"{type(e).__name__}: {e}"[:200]}

    async def sample(self, kind: str) -> dict[str, Any]:
        t = round(self.now(), 3)
        procs = await asyncio.to_thread(sample_processes, self.args.app)
        stats = await self.get_stats()
        sample = {"t": t, "kind": kind, "processes": procs, "replicas": [
            {k: r.get(k) for k in ("replica_id", "num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total")}
            for r in stats.get("replicas", [])], "router_in_flight": (stats.get("router") or {}).get("in_flight"),
            "stats_error": stats.get("error")}
        self.samples.append(sample)
        return sample

    async def sampler(self, until: float) -> None:
        while self.now() < until:
            await self.sample("periodic")
            await asyncio.sleep(max(0.0, min(self.args.sample_every, until - self.now())))

    async def idle_check(self, label: str) -> dict[str, Any]:
        """Poll /stats until every replica is idle with no KV block in use and the router has nothing in
        flight, for at most ``--pause-s`` (longer in chaos mode, where a replica may be restarting)."""
        started = self.now()
        limit = self.args.pause_s + (30.0 if self.chaos else 0.0)
        while True:
            stats = await self.get_stats()
            passed, why = is_idle(stats)
            if passed or self.now() - started >= limit:
                break
            await asyncio.sleep(0.25)
        check = {"t": round(self.now(), 3), "label": label, "passed": passed,
                 "waited_s": round(self.now() - started, 3),
                 "why": why, "router_in_flight": (stats.get("router") or {}).get("in_flight"),
                 "replicas": [{k: r.get(k) for k in ("replica_id", "num_running", "num_waiting", "kv_blocks_used")}
                              for r in stats.get("replicas", [])]}
        self.idle_checks.append(check)
        await asyncio.sleep(0.5)  # let the proxy see our closed connections before the fds are counted
        await self.sample(f"idle:{label}")
        return check

    async def chaos_monkey(self, until: float) -> None:
        """Kill one replica every ``--kill-replica-every`` seconds (Ray is connected by ``main``)."""
        every = self.args.kill_replica_every
        rng = random.Random(self.args.seed)
        next_kill = self.now() + every
        while True:
            await asyncio.sleep(max(0.0, next_kill - self.now()))
            while self.paused.is_set():  # a kill now would be charged to the idle check
                await asyncio.sleep(0.2)
            if self.now() >= until:
                return
            kill = await asyncio.to_thread(kill_one_replica, self.args.app, rng)  # ray calls block
            kill["t"] = round(self.now(), 3)
            self.kills.append(kill)
            print(f"[{kill['t']:7.1f} s] chaos: {kill}", file=sys.stderr, flush=True)
            next_kill += every

    # -- the whole run --------------------------------------------------------------------------------
    async def run(self) -> None:
        args = self.args
        total = args.minutes * 60.0
        await self.idle_check("baseline")  # not judged: the server may have been busy before we came
        end = self.now() + total  # the baseline's wait is not the load's time
        watchers = [asyncio.ensure_future(self.sampler(end))]
        if self.chaos:
            watchers.append(asyncio.ensure_future(self.chaos_monkey(end)))
        try:
            phase = 0
            while self.now() < end:
                until = min(end, self.now() + args.pause_every - args.pause_s)
                if end - until < args.pause_s:  # no room for another phase: run to the end
                    until = end
                print(f"[{self.now():7.1f} s] load phase {phase} until {until:.0f} s", file=sys.stderr, flush=True)
                await self.load_phase(until, phase)
                self.paused.set()
                check = await self.idle_check(f"pause {phase}")
                self.paused.clear()
                print(f"[{self.now():7.1f} s] idle check: {'passed' if check['passed'] else 'FAILED: ' + check['why']}",
                      file=sys.stderr, flush=True)
                phase += 1
        finally:
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            await self.stats_client.aclose()


def burst_size(admission_limit: int) -> int:
    """Half again the router's admission limit (at least 16 over it), sent at once."""
    return admission_limit + max(16, admission_limit // 2)


def is_idle(stats: dict[str, Any]) -> tuple[bool, str]:
    """Whether /stats shows an idle server: some replica answering, none with a request or a KV block, and
    the router with nothing in flight; and if not, why."""
    if "error" in stats:
        return False, stats["error"]
    replicas = stats.get("replicas") or []
    if not replicas:
        return False, "no replica answered /stats"
    busy = [f"{r.get('replica_id')}: running {r.get('num_running')}, waiting {r.get('num_waiting')}, "
            f"kv_blocks_used {r.get('kv_blocks_used')}" for r in replicas
            if r.get("num_running") or r.get("num_waiting") or r.get("kv_blocks_used")]
    in_flight = (stats.get("router") or {}).get("in_flight")
    if in_flight:
        busy.append(f"router in_flight {in_flight}")
    return not busy, "; ".join(busy)


# -- the summary (pure functions of the samples) ------------------------------------------------------------
def warmup_skip(num_samples: int, times: Sequence[float] | None = None, warmup_s: float | None = None) -> int:
    """Samples to skip as warm-up: the first 20% and at least the first 2; with ``warmup_s``, those taken in the
    first ``warmup_s`` seconds of the run instead (at least 2)."""
    if warmup_s is not None and times is not None:
        return max(2, sum(1 for t in times if t < warmup_s))
    return max(2, math.ceil(0.2 * num_samples))


def rss_growth_pct(times: Sequence[float], rss: Sequence[float], warmup_s: float | None = None) -> float | None:
    """RSS growth over the steady state, in % of its start: the least-squares slope after the warm-up, times
    the steady state's length, over the fitted RSS at its start. None with fewer than 3 steady samples."""
    skip = warmup_skip(len(times), times, warmup_s)
    t, y = np.asarray(times[skip:], dtype=float), np.asarray(rss[skip:], dtype=float)
    if len(t) < 3 or t[-1] <= t[0]:
        return None
    slope, intercept = np.polyfit(t, y, 1)
    base = slope * t[0] + intercept
    if base <= 0:
        return None
    return float(slope * (t[-1] - t[0]) / base * 100.0)


def summarize_processes(samples: Sequence[dict[str, Any]], warmup_s: float | None = None) -> dict[str, dict[str, Any]]:
    """Per role: processes seen, RSS at the first/last periodic sample (summed), the worst per-process RSS growth,
    and fds at the first/last pause (summed over the processes alive at both; the baseline is before warm-up)."""
    periodic = [s for s in samples if s["kind"] == "periodic"]
    quiet = [s for s in samples if s["kind"].startswith("idle:") and s["kind"] != "idle:baseline"]
    series: dict[int, list[tuple[float, float]]] = defaultdict(list)
    roles: dict[int, str] = {}
    for s in periodic:
        for p in s["processes"]:
            series[p["pid"]].append((s["t"], p["rss_mb"]))
            roles[p["pid"]] = p["role"]
    for s in quiet:
        for p in s["processes"]:
            roles.setdefault(p["pid"], p["role"])
    summary: dict[str, dict[str, Any]] = {}
    for role in sorted(set(roles.values())):
        pids = sorted(pid for pid, r in roles.items() if r == role)
        growth = {}
        for pid in pids:
            if series[pid] and (g := rss_growth_pct(*zip(*series[pid]), warmup_s=warmup_s)) is not None:
                growth[pid] = g
        worst = max(growth, key=growth.get) if growth else None

        def rss_at(s: dict[str, Any]) -> float:
            return sum(p["rss_mb"] for p in s["processes"] if p["role"] == role)

        fd_start = fd_end = None
        if len(quiet) >= 2:
            first = {p["pid"]: p["fds"] for p in quiet[0]["processes"] if p["role"] == role}
            last = {p["pid"]: p["fds"] for p in quiet[-1]["processes"] if p["role"] == role}
            common = first.keys() & last.keys()
            if common:
                fd_start, fd_end = sum(first[p] for p in common), sum(last[p] for p in common)
        summary[role] = {
            "processes": len(pids),
            "rss_start_mb": rss_at(periodic[0]) if periodic else None,
            "rss_end_mb": rss_at(periodic[-1]) if periodic else None,
            "rss_growth_pct": growth[worst] if worst is not None else None,
            "rss_growth_pid": worst,
            "fd_start": fd_start, "fd_end": fd_end,
        }
    return summary


@dataclass
class Limits:
    max_rss_growth_pct: float = 2.0
    max_fd_growth: int = 8
    require_no_loss: bool = False
    role_max_rss_growth_pct: dict[str, float] = field(default_factory=dict)  # per-role exceptions

    def rss_limit(self, role: str) -> float:
        return self.role_max_rss_growth_pct.get(role, self.max_rss_growth_pct)


def verdict(summary: dict[str, Any], limits: Limits) -> tuple[bool, list[str]]:
    """PASS or FAIL, and the reasons for a FAIL."""
    reasons = []
    for role, p in summary["processes"].items():
        if p["rss_growth_pct"] is not None and p["rss_growth_pct"] > limits.rss_limit(role):
            reasons.append(f"RSS of {role} (pid {p['rss_growth_pid']}) grew {p['rss_growth_pct']:.1f}% over the "
                           f"steady state (limit {limits.rss_limit(role):g}%)")
        if p["fd_start"] is not None and p["fd_end"] - p["fd_start"] > limits.max_fd_growth:
            reasons.append(f"open fds of {role} grew {p['fd_start']} -> {p['fd_end']} between pauses "
                           f"(limit +{limits.max_fd_growth})")
    if summary["num_5xx"]:
        reasons.append(f"{summary['num_5xx']} 5xx responses")
    if summary["num_unexpected"]:
        reasons.append(f"{summary['num_unexpected']} unexpected failures")
    failed = summary["idle_checks_total"] - summary["idle_checks_passed"]
    if failed:
        reasons.append(f"{failed} of {summary['idle_checks_total']} pauses did not find KV and the router idle")
    if limits.require_no_loss and summary["num_lost"]:
        reasons.append(f"{summary['num_lost']} requests lost to replica kills")
    if not summary["num_ok"]:
        reasons.append("no request succeeded")
    if summary["chaos"] and not summary["num_kills"]:
        reasons.append("chaos mode killed no replica")
    return not reasons, reasons


def summarize(soak: Soak) -> dict[str, Any]:
    by_category = Counter()
    for (_, category), n in soak.counts.items():
        by_category[category] += n
    judged = [c for c in soak.idle_checks if c["label"] != "baseline"]
    return {
        "duration_s": round(soak.now(), 1), "chaos": soak.chaos,
        "requests": sum(soak.counts.values()), "by_category": dict(by_category),
        "num_ok": by_category[OK], "num_unexpected": by_category[UNEXPECTED], "num_lost": by_category[LOST],
        "num_5xx": sum(1 for o in soak.outcomes if o.category == UNEXPECTED and o.status and o.status >= 500),
        "statuses": dict(soak.statuses),
        "idle_checks_total": len(judged), "idle_checks_passed": sum(c["passed"] for c in judged),
        "num_kills": sum(1 for k in soak.kills if k.get("killed")),
        "processes": summarize_processes(soak.samples, soak.args.warmup_minutes * 60.0
                                         if soak.args.warmup_minutes is not None else None),
    }


# -- report -------------------------------------------------------------------------------------------------
def print_report(soak: Soak, summary: dict[str, Any], passed: bool, reasons: list[str]) -> None:
    scenarios = sorted({s for s, _ in soak.counts})
    rows = [[s, *(soak.counts[(s, c)] for c in CATEGORIES), sum(soak.counts[(s, c)] for c in CATEGORIES)]
            for s in scenarios]
    rows.append(["all", *(summary["by_category"].get(c, 0) for c in CATEGORIES), summary["requests"]])
    print_table(f"requests by scenario ({summary['duration_s']:.0f} s; HTTP statuses: "
                f"{', '.join(f'{k}: {v}' for k, v in sorted(summary['statuses'].items()))})",
                ["scenario", *CATEGORIES, "total"], rows)
    rows = [[role, p["processes"], p["rss_start_mb"], p["rss_end_mb"], p["rss_growth_pct"], p["fd_start"], p["fd_end"]]
            for role, p in summary["processes"].items()]
    print_table("Ray Serve processes (RSS growth: the worst process's slope after warm-up, over the steady state; "
                "fds at the first and last pause)",
                ["role", "processes", "RSS start MiB", "RSS end MiB", "RSS growth %", "fds start", "fds end"], rows)
    rows = [[c["label"], c["t"], "yes" if c["passed"] else "NO", c["waited_s"], c["why"][:100]]
            for c in soak.idle_checks]
    print_table("idle checks at pauses (KV blocks used and router in_flight back to 0)",
                ["check", "t s", "idle", "waited s", "why not"], rows)
    unexpected = [o for o in soak.outcomes if o.category in (UNEXPECTED, LOST)]
    if unexpected:
        print("\nunexpected and lost (first 20):")
        for o in unexpected[:20]:
            print(f"  {o.t:8.1f} s  {o.scenario:18s} {o.category:10s} {o.detail}")
    if soak.chaos:
        print(f"\nchaos: {summary['num_kills']} replicas killed, {summary['num_lost']} requests lost")
    print(f"\n5xx: {summary['num_5xx']}   unexpected: {summary['num_unexpected']}   lost: {summary['num_lost']}   "
          f"idle checks passed: {summary['idle_checks_passed']}/{summary['idle_checks_total']}")
    print(f"verdict: {'PASS' if passed else 'FAIL'}" + ("" if passed else ": " + "; ".join(reasons)), flush=True)


def plot(soak: Soak, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(14, 8), sharex=True)
    samples = sorted(soak.samples, key=lambda s: s["t"])
    roles = sorted({p["role"] for s in samples for p in s["processes"]})
    t = [s["t"] for s in samples]
    for role in roles:
        axes[0][0].plot(t, [sum(p["rss_mb"] for p in s["processes"] if p["role"] == role) for s in samples], ".-",
                        label=role)
        axes[0][1].plot(t, [sum(p["fds"] for p in s["processes"] if p["role"] == role) for s in samples], ".-",
                        label=role)
    replica_ids = sorted({r["replica_id"] for s in samples for r in s["replicas"]})
    for rid in replica_ids:
        rows = [(s["t"], r) for s in samples for r in s["replicas"] if r["replica_id"] == rid]
        label = str(rid)[-8:]
        axes[1][0].plot([x for x, _ in rows], [r["kv_blocks_used"] for _, r in rows], ".-", label=label)
        axes[1][1].plot([x for x, _ in rows], [r["num_running"] for _, r in rows], ".-", label=f"{label} running")
        axes[1][1].plot([x for x, _ in rows], [r["num_waiting"] for _, r in rows], "x:", label=f"{label} waiting")
    titles = (("RSS per role, MiB", "open fds per role"), ("KV blocks in use per replica", "requests per replica"))
    for row, row_titles in zip(axes, titles):
        for ax, title in zip(row, row_titles):
            ax.set_title(title)
            for check in soak.idle_checks:
                ax.axvline(check["t"], color="green" if check["passed"] else "red", alpha=0.3, lw=1)
            for kill in soak.kills:
                ax.axvline(kill["t"], color="black", ls="--", alpha=0.5, lw=1)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("seconds (green/red: idle checks passed/failed; dashed: replica kills)")
    save_figure(fig, path)


# -- main ---------------------------------------------------------------------------------------------------
def role_limit(text: str) -> tuple[str, float]:
    role, sep, value = text.partition("=")
    try:
        pct = float(value)
    except ValueError:
        pct = -1.0
    if not sep or not role or not pct >= 0:
        raise argparse.ArgumentTypeError(f"expected ROLE=PCT with PCT >= 0, got {text!r}")
    return role, pct


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=positive_float, required=True, help="how long to run the load")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--concurrency", type=positive_int, default=8, help="workers sending requests")
    parser.add_argument("--sample-every", type=positive_float, default=10.0, metavar="S",
                        help="seconds between samples of the processes and /stats")
    parser.add_argument("--pause-every", type=positive_float, metavar="S",
                        help="seconds between idle checks (default: a quarter of the run, within 15..120)")
    parser.add_argument("--pause-s", type=positive_float, default=5.0,
                        help="longest wait at a pause for the server to be idle")
    parser.add_argument("--kill-replica-every", type=positive_float, metavar="S",
                        help="chaos: kill one LLMReplica actor every S seconds (needs a Ray node here)")
    parser.add_argument("--require-no-loss", action="store_true",
                        help="with --kill-replica-every: FAIL if any request was lost to a kill")
    parser.add_argument("--app", help="watch and kill only this Serve app's replicas (default: every app's)")
    parser.add_argument("--max-rss-growth-pct", type=float, default=2.0, metavar="PCT",
                        help="RSS growth over the steady state allowed per process")
    parser.add_argument("--role-max-rss-growth-pct", type=role_limit, action="append", default=[],
                        metavar="ROLE=PCT", help="another RSS limit for one role (proxy, controller, router, "
                                                 "replica, engine); repeatable")
    parser.add_argument("--max-fd-growth", type=int, default=8, help="open fds a role may gain between pauses")
    parser.add_argument("--warmup-minutes", type=positive_float, metavar="M",
                        help="RSS growth is judged after this much of the run (default: its first 20%%); a fresh "
                             "server meets new batch shapes for its first minutes, each costing native memory once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the scenario choices and prompts")
    parser.add_argument("--json", metavar="PATH", help="write every sample, check and failure, and the summary")
    parser.add_argument("--png", metavar="PATH", help="draw RSS, fds, KV blocks and requests over time")
    args = parser.parse_args(argv)
    args.url = args.url.rstrip("/")
    total = args.minutes * 60.0
    if args.pause_every is None:
        args.pause_every = min(120.0, max(15.0, total / 4))
    if args.pause_every <= args.pause_s:
        parser.error(f"--pause-every ({args.pause_every:g}) must be longer than --pause-s ({args.pause_s:g})")
    if args.warmup_minutes is not None and args.warmup_minutes >= args.minutes:
        parser.error("--warmup-minutes must be shorter than --minutes")
    if args.require_no_loss and args.kill_replica_every is None:
        parser.error("--require-no-loss needs --kill-replica-every")
    if args.max_fd_growth < 0 or not args.max_rss_growth_pct >= 0:
        parser.error("--max-fd-growth and --max-rss-growth-pct must be >= 0")
    return args


def _load(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


async def _setup(url: str) -> tuple[str, int]:
    """The model name (from /v1/models) and the router's admission limit (from /stats)."""
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
        models = (await client.get("/v1/models")).raise_for_status().json().get("data") or []
        stats = (await client.get("/stats")).raise_for_status().json()
    if not models:
        raise ValueError(f"{url}/v1/models lists no model")
    return models[0]["id"], int((stats.get("router") or {}).get("max_pending_requests") or 64)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model, admission_limit = asyncio.run(_setup(args.url))
    except (httpx.HTTPError, ValueError) as e:
        print(f"error: --url {args.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    load_start = load_average()

    async def go() -> Soak:
        soak = Soak(args, model, admission_limit)  # its httpx client belongs to this event loop
        await soak.run()
        return soak

    print(f"soak: {model} at {args.url} for {args.minutes:g} min, {args.concurrency} workers, bursts of "
          f"{burst_size(admission_limit)} (admission limit {admission_limit}), pause every "
          f"{args.pause_every:g} s" + (f", a replica killed every {args.kill_replica_every:g} s"
                                        if args.kill_replica_every else ""), file=sys.stderr, flush=True)
    # Ray joins from the main thread (its signal handlers need it), before the load starts.
    try:
        connected_here = args.kill_replica_every is not None and connect_ray()
    except (ConnectionError, RuntimeError) as e:
        print(f"error: --kill-replica-every needs a Ray node on this machine: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        soak = asyncio.run(go())
    finally:
        if connected_here:
            import ray

            ray.shutdown()
    summary = summarize(soak)
    limits = Limits(args.max_rss_growth_pct, args.max_fd_growth, args.require_no_loss,
                    dict(args.role_max_rss_growth_pct))
    passed, reasons = verdict(summary, limits)
    print(f"\nsoak of {model} at {args.url}: load average {_load(load_start)} at start, {_load(load_average())} at end")
    print_report(soak, summary, passed, reasons)
    if args.png:
        plot(soak, args.png)
    write_json(args.json, {
        "benchmark": "soak", "model": model, "url": args.url,
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "png")},
        "limits": asdict(limits), "summary": summary, "verdict": {"passed": passed, "reasons": reasons},
        "counts": [{"scenario": s, "category": c, "requests": n} for (s, c), n in sorted(soak.counts.items())],
        "samples": soak.samples, "idle_checks": soak.idle_checks, "kills": soak.kills,
        "not_ok": [asdict(o) for o in soak.outcomes],
    })
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
