"""argparse types the benchmarks share: whole and real numbers above zero, and comma-separated lists of numbers.

Each raises ``argparse.ArgumentTypeError`` with the text it was given, which argparse prints beside the flag."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def comma_separated(text: str, kind: type = float, noun: str = "numbers") -> list:
    """``text`` as comma-separated values of ``kind`` (``noun`` names them in the error)."""
    try:
        return [kind(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {noun}, got {text!r}") from None
