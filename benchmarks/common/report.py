"""How benchmarks show their results: tables on stdout, JSON files, PNG figures, and the machine's load.

Tables use ``rich`` when it is installed (it comes with Ray) and plain fixed-width text otherwise; either
way the numbers are the same. Figures use matplotlib's Agg backend: no display is needed.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from inflight.serve_app.sim.report import format_cell, format_table  # the one table layout (inflight simulate's too)

# -- tables ----------------------------------------------------------------------------------------------
def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], num_left: int = 1) -> None:
    """Print a titled table on stdout."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}\n{format_table(headers, rows, num_left)}", flush=True)
        return
    table = Table(header_style="bold")
    for i, header in enumerate(headers):
        table.add_column(str(header), justify="left" if i < num_left else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(format_cell(v) for v in row))
    # Piped output would otherwise be cut to 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(f"\n{title}", highlight=False)
    console.print(table)


# -- files -------------------------------------------------------------------------------------------------
def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return str(value)  # paths, dtypes, devices: their names


def pyplot():
    """matplotlib's pyplot on the Agg backend (PNG files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    print(f"wrote {path}", file=sys.stderr, flush=True)
    return path


# -- the machine ------------------------------------------------------------------------------------------
def load_average() -> float | None:
    """The 1-minute load average: other work on the machine skews CPU timings, so the reports show it."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def describe_machine() -> dict[str, Any]:
    import torch

    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_average": load_average(),
            "cuda": torch.cuda.is_available()}
