"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from inflight.kernels import cpu_kernels


@pytest.fixture(scope="module", params=["8", "16"])
def lanes(request):
    """The CPU kernels built for vectors of 8 lanes (AVX2's registers) and of 16 (AVX-512's), whatever this machine
    has: each width is its own code (key tiles, folds, sweeps of columns, a linear's rows per read), and CI may run
    on either. For modules that skip when the kernels cannot be built here."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("INFLIGHT_CPU_KERNEL_LANES", request.param)
        cpu_kernels.load.cache_clear()
        assert cpu_kernels.load() is not None
        yield int(request.param)
    cpu_kernels.load.cache_clear()
