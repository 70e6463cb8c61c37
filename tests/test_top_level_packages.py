"""Our top-level packages are ours alone in the environment.

A dependency that installs a package of the same top-level name (transformers 5.25 requires Hugging Face's
``kernels``) overwrites ours or is shadowed by it, depending on the import path: then every test that loads a
transformers model fails with an ImportError far from the cause. This test names the cause.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def our_top_level_packages() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in patterns]


def test_no_other_distribution_installs_a_package_named_as_ours():
    names = our_top_level_packages()
    assert "kernels" in names and "engine" in names
    owners = importlib.metadata.packages_distributions()
    clashes = {name: sorted(set(owners[name]) - {"inflight"}) for name in names if name in owners}
    clashes = {name: others for name, others in clashes.items() if others}
    assert not clashes, (f"installed distributions also provide our top-level packages: {clashes}; pin the "
                         f"dependency that brings them (pyproject.toml) or rename ours")
