"""Fuzzing every route with schemathesis (issue 16): from /openapi.json, which describes the real request
bodies and every error status with OpenAI's error body, it sends valid and invalid requests (``--mode all``);
none may get a 5xx, every status must be one the route declares, every declared body must validate, and the
server must be whole afterwards. A bounded run against an app whose context is short (64 tokens), so that no generated
request runs long; `docs/security.md` has the command for a longer run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serving.apps import DEMO_APP_ARGS, delete_app, deploy_app
from tests.serving.helpers import wait_idle

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
MAX_EXAMPLES = int(os.environ.get("INFLIGHT_FUZZ_EXAMPLES", "15"))
TOOL_CRASH = "SystemError: AST constructor recursion depth mismatch"
RUN_TIMEOUT_S = 360 * max(1, MAX_EXAMPLES // 25)  # a longer run (docs/security.md) gets the time it needs
pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60, func_only=True)


@pytest.fixture(scope="module")
def fuzz_app(ray_cluster):
    args = {**DEMO_APP_ARGS, "num_cpus_per_replica": 0.5,
            "engine_args": {**DEMO_APP_ARGS["engine_args"], "max_model_len": 64}}
    yield deploy_app(args, name="fuzz", route_prefix="/fuzz")
    delete_app("fuzz")


@pytest.mark.skipif(not SCHEMATHESIS.exists(), reason="schemathesis is not installed (pip install -e '.[test]')")
def test_no_route_answers_a_5xx_to_anything(fuzz_app, tmp_path):
    command = [str(SCHEMATHESIS), "run", f"{fuzz_app}/openapi.json", "--url", fuzz_app, "--checks",
               "not_a_server_error,status_code_conformance,response_schema_conformance",
               "--mode", "all", "--max-examples", str(MAX_EXAMPLES), "--request-timeout", "60",
               "--generation-deterministic", "--workers", "1", "--phases", "examples,coverage,fuzzing"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=tmp_path)
    if result.returncode != 0 and TOOL_CRASH in result.stdout:
        # The fuzzer itself crashed while drawing an example: CPython 3.11's ast recursion counter is not safe
        # when two threads parse at once (hypothesis parses lambdas' source to describe strategies). One worker
        # thread avoids it (two workers crashed twice in a row in a fresh clone on 2026-12-03); should it come
        # anyway, run again rather than report a tool bug. The generation is deterministic, so a real failure of
        # a check comes back in the second run.
        result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert httpx.get(fuzz_app + "/health", timeout=10.0).status_code == 200
    stats = wait_idle(fuzz_app, timeout=60.0)
    assert all(r["kv_blocks_used"] == 0 for r in stats["replicas"])
