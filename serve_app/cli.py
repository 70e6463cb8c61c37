"""``inflight serve MODEL [flags]`` or ``inflight serve --config FILE [flags]``: the app on Ray Serve, like ``vllm serve``.

Every ``EngineConfig`` and ``AppConfig`` field is a flag (``serve_app/cli_args.py``), checked by the classes' own
validators before Ray starts. Without ``--config`` the flags make a one-application Serve config (as
configs/demo-tiny.yaml: the app ``inflight`` at ``/``); with it, the file is run as ``serve run FILE`` runs it,
and the flags given override each inflight application's args in it (engine flags inside ``engine_args``; MODEL
its ``model``), ``--host``/``--proxy-port`` its ``http_options``.

Ray: ``--address``, else ``RAY_ADDRESS``, else a cluster running on this machine is served into; with none (or
``--address local``) a local one is started, with the settings ``make run`` uses (``serve_app/ray_env.py``;
``RAY_AUTH_MODE=disabled`` unless set), on the CPUs the engines leave (``engine_cpus``, ``serve_app/cpu_plan.py``).
The API is the router's own port, ``--port`` (Serve's direct ingress allocates from it), Serve's proxy serves it
too on ``--proxy-port``. Served into an existing cluster, its Serve config is replaced (as ``serve run FILE
--address auto`` would), and the router's port is where that cluster's Serve puts it: the URL printed is the
real one. Ctrl-C or SIGTERM deletes the applications, and stops Serve and Ray if this command started them.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from inflight.engine.config import EngineConfig
from inflight.serve_app import cli_args, cpu_plan, ports, ray_env
from inflight.serve_app.config import AppConfig

BUILDER = "inflight.serve_app.app:build_app"
APP_NAME = "inflight"
DEFAULT_HOST = "127.0.0.1"
PORT_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"
MAX_PORT_ENV = "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"
ENGINE_FIELDS = [field for field in cli_args.dataclass_fields(EngineConfig) if field.name != "model"]
APP_FIELDS = [field for field in cli_args.pydantic_fields(AppConfig) if field.name not in ("model", "engine_args")]


class ServeError(Exception):
    """Something that stops ``inflight serve``, said in one line."""


def build_parser(prog: str = "inflight serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, usage="%(prog)s [MODEL] [--config FILE] [--port PORT] [engine and app flags]",
        description="Serve a model's OpenAI-compatible API on Ray Serve. Every engine (EngineConfig) and app "
                    "(AppConfig) argument is a flag; values other than strings and bools are JSON.")
    parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
                        help="a packaged model's name, a .gguf file, a checkpoint directory, or demo-tiny "
                             f"(default: {AppConfig.model_fields['model'].default})")
    command = parser.add_argument_group("serving")
    command.add_argument("--config", type=Path, metavar="FILE", help="a Serve config file (configs/*.yaml) to run, as `serve run "
                                                     "FILE` does; the flags given override its inflight apps' args")
    command.add_argument("--port", type=int, help="the API's port: the router's own, Serve's direct ingress "
                                                  f"(default: ${PORT_ENV}, else {ray_env.API_PORT})")
    command.add_argument("--proxy-port", type=int, default=argparse.SUPPRESS,
                         help=f"Serve's proxy port, http_options.port (default: {ray_env.LOCAL_PROXY_PORT}, or the "
                              "config's)")
    command.add_argument("--host", default=argparse.SUPPRESS,
                         help=f"where Serve listens, http_options.host (default: {DEFAULT_HOST}, or the config's)")
    command.add_argument("--address", help="the Ray cluster to serve into; 'local': always start a new one "
                                           "(default: $RAY_ADDRESS, else one running here, else a new local one)")
    cli_args.add_config_flags(parser.add_argument_group("engine arguments (EngineConfig)"), ENGINE_FIELDS)
    cli_args.add_config_flags(parser.add_argument_group("app arguments (AppConfig)"), APP_FIELDS)
    return parser


def serve_config_from(args: argparse.Namespace) -> dict[str, Any]:
    """The Serve config (a dict, as in configs/*.yaml) that ``args`` ask for, its inflight apps' args checked."""
    overrides = cli_args.given(args, APP_FIELDS)
    engine_overrides = cli_args.given(args, ENGINE_FIELDS)
    if hasattr(args, "model"):
        overrides["model"] = args.model
    if args.config is None:
        config = {"proxy_location": "HeadOnly", "http_options": {"host": DEFAULT_HOST, "port": ray_env.LOCAL_PROXY_PORT},
                  "logging_config": {"enable_access_log": overrides.get("access_log", False)},
                  "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": BUILDER, "args": {}}]}
    else:
        try:
            config = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ServeError(f"--config {args.config}: {e}".replace("\n", " ")) from None
    http_options = config.setdefault("http_options", {})
    for name, key in (("host", "host"), ("proxy_port", "port")):
        if hasattr(args, name):
            http_options[key] = getattr(args, name)
    ours = [app for app in config.get("applications") or [] if app.get("import_path") == BUILDER]
    if not ours and (overrides or engine_overrides):
        raise ServeError(f"{args.config} has no application of {BUILDER} for the engine and app flags to apply to")
    for app in ours:
        app_args = app.setdefault("args", {})
        app_args.update(copy.deepcopy(overrides))
        app_args["engine_args"] = {**(app_args.get("engine_args") or {}), **engine_overrides}
        try:
            AppConfig.model_validate(app_args)
        except ValidationError as e:
            where = "argument" if args.config is None else f"{args.config} (application {app.get('name')!r}) argument"
            raise ServeError(explain(e, where)) from None
    return config


def explain(error: ValidationError, where: str) -> str:
    """A validation error in one line, naming the flag: ``argument --max-num-seqs: ...``."""
    first = error.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    name = str(first["loc"][0]) if first["loc"] else ""
    if name == "engine_args":  # the engine's ValueError names its field first (speculative_config.method ...)
        name = message.split(" ", 1)[0].split(".", 1)[0]
    flag = f" --{name.replace('_', '-')}" if name else ""  # none: a check of several fields together
    if len(first["loc"]) > 1 and first["loc"][0] != "engine_args":  # inside a JSON value: where in it
        flag += f" ({'.'.join(map(str, first['loc'][1:]))})"
    return f"{where}{flag}: {message}".replace("\n", " ")


def connect_ray(address: str | None, serve_config: dict[str, Any]) -> bool:
    """Connect to a cluster, or start a local one; True when this process started it."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    address = address or os.environ.get("RAY_ADDRESS")
    if address is None:
        try:
            ray.init(address="auto", namespace=SERVE_NAMESPACE)
            return False
        except ConnectionError:  # no cluster running here
            address = "local"
    if address != "local":
        ray.init(address=address, namespace=SERVE_NAMESPACE)
        return False
    host = serve_config["http_options"].get("host", DEFAULT_HOST)
    for port in (int(os.environ[PORT_ENV]), serve_config["http_options"].get("port", 8000)):
        if not ports.port_free(port, host):  # Serve would move the router to the next free port, or fail the proxy
            raise ServeError(f"port {port} on {host} is taken (another server?): choose another with --port or "
                             "--proxy-port")
    cpus = cpu_plan.serving_cpus(serve_config)
    if cpus is not None:  # Ray's processes inherit this: the engines' CPUs are left to them
        print(f"engines have CPUs of their own: Ray's processes run on CPUs {sorted(cpus)}", flush=True)
        os.sched_setaffinity(0, cpus)
    ray.init(address="local", namespace=SERVE_NAMESPACE)
    return True


def deploy(serve_config: dict[str, Any]) -> list[str]:
    """Submit the config as ``serve run FILE`` does; the names of its applications."""
    from ray.serve._private import api as serve_api
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    try:
        schema = ServeDeploySchema.model_validate(serve_config)
    except ValidationError as e:
        first = e.errors()[0]
        raise ServeError(f"serve config {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    client = serve_api.serve_start(http_options=schema.http_options.model_dump(),
                                   proxy_location=schema.proxy_location,
                                   grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
                                   controller_options=schema.controller_options)
    client.deploy_apps(schema, _blocking=False)
    return [app.name for app in schema.applications]


def wait_running(names: list[str], stop: threading.Event) -> None:
    """Until every application runs (or ``stop`` is set); a ``ServeError`` for one that failed."""
    from ray import serve

    for name in names:
        while not stop.is_set():
            status = serve.status().applications.get(name)
            if status is not None and status.status == "RUNNING":
                break
            if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise ServeError(f"application {name!r} failed to deploy: {status.message}".replace("\n", " "))
            stop.wait(0.5)


def main(argv: list[str] | None = None, prog: str = "inflight serve") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    # Before anything imports ray.serve or starts Ray (ray_env.apply): Serve's settings, the API port, no token auth
    if args.port is not None:  # Serve allocates the routers' ports from it up to the range's end (Ray's: 31000)
        os.environ[PORT_ENV] = str(args.port)
        os.environ.setdefault(MAX_PORT_ENV, str(min(args.port + 1000, 65535)))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray >= 2.59 turns token auth on for local clusters
    ray_env.apply(local=True)
    try:
        serve_config = serve_config_from(args)
    except ServeError as e:
        parser.error(str(e))

    import ray
    from ray import serve

    stop = threading.Event()
    started, names = False, []
    try:
        started = connect_ray(args.address, serve_config)
        if not started and args.port is not None:
            print("note: serving into a running cluster, whose Serve put the router's port where its own settings "
                  "say, not at --port: the API is where printed below", flush=True)
        for signum in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets a SIGTERM handler of its own
            signal.signal(signum, lambda *_: stop.set())
        names = deploy(serve_config)
        wait_running(names, stop)
        host = serve_config["http_options"].get("host", DEFAULT_HOST)
        shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        ours = [app["name"] for app in serve_config["applications"] if app.get("import_path") == BUILDER]
        for name in names if not stop.is_set() else []:
            api = f"; API: {ports.wait_for_router_url(name, shown_host)}/v1" if name in ours else ""
            print(f"application {name!r} running{api}", flush=True)
        proxy = serve_config["http_options"].get("port", 8000)  # a running cluster's Serve keeps its own
        print(f"Serve's proxy: http://{shown_host}:{proxy}; " if started else "", "Ctrl-C stops", sep="", flush=True)
        while not stop.wait(1.0):
            pass
        print("stopping ...", flush=True)
        return 0
    except ServeError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if ray.is_initialized():
            if started:
                serve.shutdown()
            else:
                for name in names:
                    serve.delete(name)
            ray.shutdown()
