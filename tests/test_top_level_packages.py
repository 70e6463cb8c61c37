"""One import name, ``inflight``, ours alone in the environment, importable from anywhere.

A dependency that installs a package of the same top-level name overwrites ours or is shadowed by it, depending on
the import path: then every test that loads it fails with an ImportError far from the cause (transformers 5.25
requires Hugging Face's ``kernels``, the name our kernels/ folder installed as until it became
``inflight.kernels``). This test names the cause.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def our_top_level_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name.split(".")[0] for name in config["tool"]["setuptools"]["packages"]}


def test_we_install_one_top_level_package_and_no_other_distribution_shares_it():
    assert our_top_level_packages() == {"inflight"}
    owners = importlib.metadata.packages_distributions()
    assert set(owners.get("inflight", ["inflight"])) == {"inflight"}, owners["inflight"]
    ours = {name for name, dists in owners.items() if "inflight" in dists}
    assert ours == {"inflight"}, f"the installed inflight provides other top-level names too: {sorted(ours)}"


@pytest.mark.slow
def test_the_public_api_imports_from_anywhere_and_the_folders_names_do_not():
    """From a directory outside the checkout (the installed package) and from its root (the folders beside
    ``inflight/``); the folders' own names refuse, so no module is ever loaded twice."""
    script = ("import inflight, inflight.engine.llm_engine as m; print(inflight.LLM.__module__, m.__name__)\n"
              "try:\n    import engine\nexcept ImportError as e:\n    print('refused:', e)\n"
              "try:\n    import kernels, inflight.kernels as k\n    print(kernels.AttentionBackend is k.AttentionBackend)\n"
              "    import kernels.cpu_kernels\nexcept ImportError as e:\n    print('refused:', e)\n")
    for cwd in ("/", ROOT):
        done = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == "inflight.engine.llm inflight.engine.llm_engine", (cwd, lines)
        if cwd == ROOT:  # (elsewhere there is no engine/ folder to import by mistake)
            assert lines[1].startswith("refused: import inflight.engine, not engine"), lines
            # kernels/ by its own name (transformers probes for that name): a shell over inflight.kernels' names
            assert lines[2:] == ["True", "refused: No module named 'kernels.cpu_kernels'"], lines


@pytest.mark.slow
def test_the_wheel_holds_inflight_alone_with_the_kernels_source(tmp_path):
    """``pip install .`` installs what the wheel holds: ``inflight/`` (the three folders inside it, and the CPU
    kernels' C++ source, built on first use), no benchmarks, no tests, no other top-level name."""
    import zipfile

    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("inflight-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"inflight", wheel.name.split("-py3")[0] + ".dist-info"}
    folders = {"/".join(name.split("/")[:2]) for name in names if name.count("/") >= 2}
    assert folders == {"inflight/engine", "inflight/kernels", "inflight/serve_app"}, folders
    assert "inflight/kernels/csrc/cpu_kernels.cpp" in names and "inflight/engine/models/cpu_decode.py" in names
