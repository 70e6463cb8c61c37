"""vLLM runs with tcmalloc and its Intel OpenMP preloaded (benchmarks.peers.preload), or says why not."""

from __future__ import annotations

from benchmarks.peers import preload
from benchmarks.peers.vllm_baseline import VllmSettings, worker_env


def fake_venv(tmp_path, tcmalloc=True, iomp=True):
    venv = tmp_path / "peer"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    if iomp:
        (venv / "lib" / "libiomp5.so").write_bytes(b"")
    if tcmalloc:
        lib = venv / preload.UNPACKED_TCMALLOC
        lib.parent.mkdir(parents=True)
        lib.write_bytes(b"")
    return str(venv / "bin" / "python")


def test_both_libraries_go_first_in_ld_preload(tmp_path, monkeypatch):
    monkeypatch.setattr(preload, "SYSTEM_LIBS", [])
    python = fake_venv(tmp_path)
    env = preload.with_peer_preload(python, {"LD_PRELOAD": "/other.so", "PATH": "/bin"})
    libs = env["LD_PRELOAD"].split(":")
    assert libs[0].endswith("libtcmalloc_minimal.so.4") and libs[1].endswith("lib/libiomp5.so")
    assert libs[2:] == ["/other.so"] and env["PATH"] == "/bin"
    # the offline worker gets them
    assert worker_env(VllmSettings(python), {})["LD_PRELOAD"] == ":".join(libs[:2])


def test_a_missing_library_is_named_in_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(preload, "SYSTEM_LIBS", [])
    python = fake_venv(tmp_path, tcmalloc=False)
    assert [p.rsplit("/", 1)[-1] for p in preload.peer_preload(python)] == ["libiomp5.so"]
    assert "tcmalloc not found" in capsys.readouterr().err
    assert "LD_PRELOAD" not in preload.with_peer_preload(fake_venv(tmp_path / "b", False, False), {})
