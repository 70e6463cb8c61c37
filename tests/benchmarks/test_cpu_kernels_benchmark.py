"""benchmarks.micro.cpu_kernels: a table of every kernel for each width asked, and a bad width named."""

from __future__ import annotations

import os

import pytest

from benchmarks.micro import cpu_kernels as bench
from inflight.kernels import cpu_kernels


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


def test_matmuls_table_has_a_row_per_linear_and_row_count(capsys):
    try:
        bench.main(["--lanes", "native", "--calls", "2", "--matmuls", "--rows", "1,3"])
    finally:
        cpu_kernels.load.cache_clear()
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("| in x out | rows | oneDNN packed (ms) | MKL F.linear (ms) | cpu_kernels.linear (ms) |")
    rows = [line.split(" | ") for line in lines[start + 2:]]
    assert len(rows) == 2 * len(bench.MODEL_LINEARS)
    assert [row[1] for row in rows[:2]] == ["1", "3"]
    assert all(float(cell.strip(" |")) > 0 for row in rows for cell in row[2:])


@pytest.mark.parametrize("rows", ["1,x", "0"])
def test_bad_rows_are_named(rows, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--matmuls", "--rows", rows])
    assert "--rows" in capsys.readouterr().err
