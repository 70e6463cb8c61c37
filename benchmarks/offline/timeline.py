"""Which request held each batch slot at each step: the same requests in static and in continuous batching.

The seed's picture: requests A-E share a few slots; in continuous batching a slot is refilled the step
after its request ends, in static batching it is padding until the batch's longest member ends and idle
if the batch was not full. The requests (``--output-lens``, one per request, named A, B, C, ...; prompts
of ``--prompt-len`` tokens) all arrive at once and run through ``LLMEngine`` on demo-tiny with
``--slots`` batch slots, once per mode; every step is recorded (``LLMEngine.step_listener``).

Slots are numbered by the engine's running set: a request takes the lowest free slot when it is admitted
and keeps it until it leaves. Each step a slot is: prefill (the request computes prompt tokens), decode
(it computes one generated token), padding (static batching: done, but computed to keep the batch),
held (admitted but not computed this step: the token budget ran out), or idle.

    python -m benchmarks.offline.timeline --plot docs/images/timeline.png
"""

from __future__ import annotations

import argparse
import string
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from benchmarks.common.engine import build_engine
from benchmarks.common.engine_run import run_engine
from benchmarks.common.flags import comma_separated, positive_int
from benchmarks.common.report import print_table, pyplot, save_figure, write_json
from benchmarks.common.workloads import BenchRequest

MODES = ("static", "continuous")
STATES = ("prefill", "decode", "padding", "held", "idle")
DEMO_FIRST_BYTE_ID = 7  # demo-tiny's byte ids start here


@dataclass(frozen=True)
class Cell:
    request: str | None  # the caller's id of the request holding the slot; None when idle
    state: str  # one of STATES


def slot_timeline(records: Sequence[Any], num_slots: int) -> list[list[Cell]]:
    """``[step][slot]`` cells from the engine's step records (``StepRecord`` or anything with its fields)."""
    slot_of: dict[str, int] = {}  # sequence id -> its slot
    seen: set[str] = set()  # sequences computed at least once
    grid = []
    for record in records:
        holders = record.running_ids
        for sequence in [s for s in slot_of if s not in holders]:
            del slot_of[sequence]
        for sequence in holders:
            if sequence not in slot_of:
                free = sorted(set(range(num_slots)) - set(slot_of.values()))
                if not free:
                    raise ValueError(f"more requests hold a slot than the {num_slots} slots")
                slot_of[sequence] = free[0]
        batch = record.batch
        rows = {rid: (n, sample, padding) for rid, n, sample, padding
                in zip(batch.request_ids, batch.query_lens, batch.sample, batch.padding)}
        cells = [Cell(None, "idle")] * num_slots
        for sequence, slot in slot_of.items():
            label = record.parent_ids.get(sequence, sequence)
            if sequence not in rows:
                state = "held"
            else:
                num_tokens, sample, padding = rows[sequence]
                first = sequence not in seen
                state = "padding" if padding else "prefill" if num_tokens > 1 or not sample or first else "decode"
            cells[slot] = Cell(label, state)
        seen.update(rows)
        grid.append(cells)
    return grid


def count_states(grid: list[list[Cell]]) -> dict[str, int]:
    counts = dict.fromkeys(STATES, 0)
    for cells in grid:
        for cell in cells:
            counts[cell.state] += 1
    return counts


# -- runs -----------------------------------------------------------------------------------------------
def requests_of(output_lens: Sequence[int], prompt_len: int) -> list[BenchRequest]:
    return [BenchRequest([DEMO_FIRST_BYTE_ID + 20 * i + j for j in range(prompt_len)], n)
            for i, n in enumerate(output_lens)]


def run_mode(mode: str, requests: Sequence[BenchRequest], args) -> list[list[Cell]]:
    engine = build_engine("demo-tiny", device="cpu", num_threads=1, batching=mode, max_num_seqs=args.slots,
                          max_num_batched_tokens=max(args.slots, args.max_num_batched_tokens), block_size=4,
                          num_kv_blocks=256)
    run = run_engine(engine, requests, desc=mode, keep_records=True)
    labels = {str(i): name for i, name in enumerate(args.names)}
    for record in run.records:  # the engine's ids are our request indices: show the letters
        record.parent_ids.update({s: labels[p] for s, p in record.parent_ids.items()})
    return slot_timeline(run.records, args.slots)


# -- report ---------------------------------------------------------------------------------------------
def print_grids(grids: dict[str, list[list[Cell]]], num_slots: int) -> None:
    marks = {"prefill": str.upper, "decode": str.lower, "padding": lambda _: "-", "held": lambda _: "~",
             "idle": lambda _: "."}
    for mode, grid in grids.items():
        print(f"\n{mode}: {len(grid)} steps (A = prefill, a = decode, - = padding, ~ = held, . = idle)")
        for slot in range(num_slots):
            row = "".join(marks[c.state](c.request or "?") for c in (cells[slot] for cells in grid))
            print(f"  slot {slot}: {row}")


def plot(grids: dict[str, list[list[Cell]]], names: Sequence[str], num_slots: int, path: str) -> None:
    plt = pyplot()
    from matplotlib.patches import Patch

    colour = {name: f"C{i % 10}" for i, name in enumerate(names)}
    width = max(len(g) for g in grids.values())
    fig, axes = plt.subplots(1, len(grids), figsize=(max(8.0, 0.42 * width * len(grids)), 0.7 * num_slots + 2.2),
                             sharey=True, squeeze=False)
    for ax, (mode, grid) in zip(axes[0], grids.items()):
        for step, cells in enumerate(grid, start=1):
            for slot, cell in enumerate(cells):
                if cell.state == "idle":
                    ax.add_patch(plt.Rectangle((step - 0.5, slot - 0.4), 1, 0.8, facecolor="white",
                                               edgecolor="#bbbbbb", linestyle=":"))
                    continue
                padding = cell.state == "padding"
                ax.add_patch(plt.Rectangle(
                    (step - 0.5, slot - 0.4), 1, 0.8, facecolor="#d9d9d9" if padding else colour[cell.request],
                    edgecolor=colour[cell.request] if padding else "white",
                    hatch={"prefill": "//", "padding": "xx", "held": ".."}.get(cell.state, ""),
                    alpha=1.0 if cell.state != "held" else 0.5))
                if cell.state == "prefill" and (step == 1 or grid[step - 2][slot].request != cell.request):
                    ax.text(step, slot, cell.request, ha="center", va="center", fontsize=9, fontweight="bold",
                            color="white")
        counts = count_states(grid)
        busy = counts["prefill"] + counts["decode"]
        ax.set_title(f"{mode}: {len(grid)} steps, {busy} useful slot-steps, {counts['padding']} padding, "
                     f"{counts['idle']} idle", fontsize=10)
        ax.set_xlim(0.5, width + 0.5)
        ax.set_ylim(-0.6, num_slots - 0.4)
        ax.set_xlabel("step")
        ax.set_yticks(range(num_slots), [f"slot {s}" for s in range(num_slots)])
        ax.invert_yaxis()
    handles = [Patch(facecolor=colour[n], label=n) for n in names] + [
        Patch(facecolor="white", edgecolor="black", hatch="//", label="prefill"),
        Patch(facecolor="#d9d9d9", edgecolor="black", hatch="xx", label="padding"),
        Patch(facecolor="white", edgecolor="#bbbbbb", linestyle=":", label="idle")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle("batch slots per step: one colour per request (static batching left, continuous right)")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    save_figure(fig, path)


# -- main -----------------------------------------------------------------------------------------------
def parse_output_lens(text: str) -> list[int]:
    values = comma_separated(text, int, "integers")
    if not values or min(values) < 1 or len(values) > len(string.ascii_uppercase):
        raise argparse.ArgumentTypeError(f"expected 1 to 26 integers >= 1, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offline.timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-lens", type=parse_output_lens, default=parse_output_lens("10,4,16,6,8"),
                        help="output tokens of each request, comma-separated; the requests are named A, B, C, ...")
    parser.add_argument("--prompt-len", type=positive_int, default=8, help="prompt tokens of every request")
    parser.add_argument("--slots", type=positive_int, default=3, help="batch slots (max_num_seqs) in both modes")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="tokens per step")
    parser.add_argument("--plot", metavar="PATH.png", default="timeline.png", help="where the Gantt chart goes")
    parser.add_argument("--json", metavar="PATH", help="also write the grids as JSON here")
    args = parser.parse_args(argv)
    if args.prompt_len > 200:
        parser.error(f"--prompt-len must be <= 200 for demo-tiny's byte prompts, got {args.prompt_len}")
    args.names = list(string.ascii_uppercase[:len(args.output_lens)])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    requests = requests_of(args.output_lens, args.prompt_len)
    grids = {mode: run_mode(mode, requests, args) for mode in MODES}
    print_grids(grids, args.slots)
    rows = []
    for mode, grid in grids.items():
        counts = count_states(grid)
        cells = len(grid) * args.slots
        rows.append([mode, len(grid), counts["prefill"] + counts["decode"], counts["padding"], counts["idle"],
                     counts["held"], f"{(counts['prefill'] + counts['decode']) / cells:.0%}"])
    print_table(f"slot-steps, {len(requests)} requests in {args.slots} slots",
                ["mode", "steps", "useful", "padding", "idle", "held", "useful share"], rows)
    plot(grids, args.names, args.slots, args.plot)
    write_json(args.json, {
        "benchmark": "timeline", "config": {k: v for k, v in vars(args).items() if k != "json"},
        "grids": {mode: [[[c.request, c.state] for c in cells] for cells in grid] for mode, grid in grids.items()},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
