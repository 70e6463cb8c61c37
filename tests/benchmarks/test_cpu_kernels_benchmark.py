"""benchmarks.cpu_kernels: a table of every kernel for each width asked, and a bad width named."""

from __future__ import annotations

import os

import pytest

from benchmarks import cpu_kernels as bench
from kernels import cpu_kernels


def test_one_row_per_kernel_and_a_column_per_width(capsys):
    try:
        bench.main(["--lanes", "native,16", "--calls", "2"])
    finally:
        os.environ.pop("INFLIGHT_CPU_KERNEL_LANES", None)
        cpu_kernels.load.cache_clear()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| kernel, shape (ms, median) | native lanes | 16 lanes |"
    rows = [line.split(" | ") for line in lines[2:]]
    assert len(rows) == len(bench.cases())
    assert all(float(cell.strip(" |")) > 0 for row in rows for cell in row[1:])


def test_a_bad_width_is_named():
    with pytest.raises(SystemExit):
        bench.main(["--lanes", "native,12"])
