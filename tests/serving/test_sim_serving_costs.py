"""``inflight profile --serving-url``: the serving path's costs measured on a running server (the shared demo app)."""

from __future__ import annotations

import math

from inflight.__main__ import main
from inflight.serve_app.sim.profile import Profile


def test_a_running_servers_costs_go_into_the_profile(server, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["profile", "demo-tiny", "--quick", "--device", "cpu", "--max-num-seqs", "8", "--max-model-len", "512",
                 "--num-kv-blocks", "64", "--serving-url", server, "--out", str(out)]) == 0
    serving = Profile.load(out).serving
    assert all(math.isfinite(v) and v >= 0 for v in (serving.request_s, serving.message_s))
    assert "a streamed token" in capsys.readouterr().out
