"""``inflight serve`` end to end: the command in a process of its own, its API on free ports, a completion answered,
then a signal and a clean exit.

Ray start-ups are the cost here (~10 s each on two shared cores), so one cluster serves both ways of starting: the
first command, a model named by flags, starts a cluster of its own (``--address local``, so it never serves into the
session cluster of tests/serving/fixtures.py); the second runs a config file into that cluster (``--address`` its
GCS), which replaces its Serve config. SIGTERM, as a supervisor sends it to the command alone, makes the second
delete its applications and leave the cluster running; Ctrl-C, SIGINT to the first's whole process group as a
terminal sends it, makes the first shut down Serve and the Ray it started.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.helpers import HOST, MODEL

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240  # a Ray cluster and the app from nothing, on two shared cores
EXIT_TIMEOUT_S = 90
GONE_TIMEOUT_S = 30  # after a clean exit, for what it stopped to be gone


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path, int]:
    """``python -m inflight serve ARGS`` on free ports, its output in a file (a pipe nobody reads would fill)."""
    port, proxy_port = free_port(), free_port()
    log = tmp_path / f"serve-{port}.log"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT")}
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "inflight", "serve", *args, "--port", str(port),
                                    "--proxy-port", str(proxy_port)],
                                   cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return process, log, port


def wait_for_api(process: subprocess.Popen, log: Path) -> str:
    """The API's base URL, once the command prints it."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"inflight serve exited ({process.returncode}):\n{log.read_text()[-3000:]}"
        printed = re.search(r"API: (http://\S+)/v1\n", log.read_text())
        if printed:
            return printed.group(1)
        time.sleep(1.0)
    pytest.fail(f"no API printed within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def complete(url: str) -> None:
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
                          timeout=60.0)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] is not None


def ray_address(process: subprocess.Popen, log: Path) -> str:
    """The GCS address of the cluster ``process`` started: its Ray processes (in its process group) are given it."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != process.pid:
                continue
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        for arg in args:
            if arg.startswith(b"--gcs-address="):
                return arg.split(b"=", 1)[1].decode()
    pytest.fail(f"no process of the cluster that inflight serve started names its GCS:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen, log: Path, signum: int) -> None:
    """SIGINT as a terminal's Ctrl-C sends it, to the whole process group (Ray's processes too); SIGTERM as a
    supervisor does, to the command alone."""
    if signum == signal.SIGINT:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    try:
        returncode = process.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the command and the Ray it started (its process group)
        process.wait()
        pytest.fail(f"inflight serve still running {EXIT_TIMEOUT_S} s after {signum!r}:\n{log.read_text()[-3000:]}")
    assert returncode == 0, log.read_text()[-3000:]
    assert "stopping ..." in log.read_text(), log.read_text()[-3000:]


def wait_gone(what: str, gone, log: Path) -> None:
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while not gone():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} still there {GONE_TIMEOUT_S} s after inflight serve exited:\n"
                        f"{log.read_text()[-3000:]}")
        time.sleep(0.5)


def api_gone(url: str) -> bool:
    try:
        httpx.get(f"{url}/v1/models", timeout=5.0)
    except httpx.TransportError:
        return True
    return False


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(2 * (START_TIMEOUT_S + EXIT_TIMEOUT_S + GONE_TIMEOUT_S) + 60, func_only=True)
def test_serve_a_model_named_by_flags_and_a_config_file_into_its_cluster_then_sigterm_and_ctrl_c(tmp_path):
    config = ROOT / "configs" / "demo-tiny.yaml"
    assert config.is_file()
    first, first_log, _ = start(tmp_path, MODEL, "--max-model-len", "512", "--num-threads", "1", "--address", "local")
    try:
        complete(wait_for_api(first, first_log))
        second, second_log, _ = start(tmp_path, "--config", str(config), "--address", ray_address(first, first_log))
        try:
            url = wait_for_api(second, second_log)
            complete(url)
        finally:
            if second.poll() is None:
                stop(second, second_log, signal.SIGTERM)
        wait_gone("the config's application", lambda: api_gone(url), second_log)  # deleted, by the command alone
        assert first.poll() is None, first_log.read_text()[-3000:]  # the cluster is not the second's to stop
    finally:
        if first.poll() is None:
            stop(first, first_log, signal.SIGINT)
    wait_gone("a process of the Ray it started", lambda: group_gone(first.pid), first_log)
