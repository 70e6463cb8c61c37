"""``inflight serve`` end to end: the command in a process of its own, a cluster of its own (``--address local``, so
it never serves into the session cluster of tests/serving/fixtures.py), its API on free ports, a completion
answered, then a signal and a clean exit (Serve and the Ray it started shut down).
"""

from __future__ import annotations

import os
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
                                    "--proxy-port", str(proxy_port), "--address", "local"],
                                   cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return process, log, port


def wait_for_api(process: subprocess.Popen, log: Path, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"inflight serve exited ({process.returncode}):\n{log.read_text()[-3000:]}"
        if f"API: {url}/v1" in log.read_text():
            return
        time.sleep(1.0)
    pytest.fail(f"no API at {url} within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


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


def serve_and_complete(tmp_path: Path, signum: int, *args: str) -> None:
    process, log, port = start(tmp_path, *args)
    try:
        url = f"http://{HOST}:{port}"
        wait_for_api(process, log, url)
        response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
                              timeout=60.0)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] is not None
    finally:
        if process.poll() is None:
            stop(process, log, signum)


@pytest.mark.timeout(START_TIMEOUT_S + EXIT_TIMEOUT_S + 60, func_only=True)
def test_serve_a_model_named_by_flags_then_ctrl_c(tmp_path):
    serve_and_complete(tmp_path, signal.SIGINT, MODEL, "--max-model-len", "512", "--num-threads", "1")


@pytest.mark.timeout(START_TIMEOUT_S + EXIT_TIMEOUT_S + 60, func_only=True)
def test_serve_a_config_file_then_sigterm(tmp_path):
    config = ROOT / "configs" / "demo-tiny.yaml"
    assert config.is_file()
    serve_and_complete(tmp_path, signal.SIGTERM, "--config", str(config))
