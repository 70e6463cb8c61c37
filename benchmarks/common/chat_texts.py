"""The texts of the ``chat`` workload: questions, and passages of prose from this repository's own documents.

``benchmarks/common/texts/passages.json`` holds the prose paragraphs of README.md and docs/*.md as they were when it
was written (code blocks, tables, headings and short paragraphs left out; at most ``MAX_PER_FILE`` of each),
so that a workload drawn from a seed is the same whatever the documents say later. Regenerate it (a changed file
changes every chat workload: say so where numbers are compared) with

    python -m benchmarks.common.chat_texts --write
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PASSAGES = Path(__file__).resolve().parent / "texts" / "passages.json"
SOURCES = ("README.md", "docs/architecture.md", "docs/security.md", "docs/benchmarks-history.md")
MIN_CHARS = 200  # shorter paragraphs are mostly captions and list items
MAX_PER_FILE = 40  # the first paragraphs of each file (docs/benchmarks-history.md alone has ~200, most of them figures)

# What the user asks about a passage; "{passage}" is replaced by it.
QUESTIONS = (
    "Summarize this:\n\n{passage}",
    "What is the main point of the following text?\n\n{passage}",
    "Explain the following to a new engineer on the team, in a few sentences:\n\n{passage}",
    "{passage}\n\nList the key facts in the text above.",
    "Write a short title for this text:\n\n{passage}",
    "Read this and tell me which problem it describes and how it is solved:\n\n{passage}",
    "{passage}\n\nWhat questions would you ask the author of this text?",
    "Rewrite the following in plain English:\n\n{passage}",
)


def prose_paragraphs(markdown: str) -> list[str]:
    """The paragraphs of ``markdown`` that are prose: its lines joined, code fences, tables, headings, images and
    HTML left out."""
    paragraphs, block, fenced = [], [], False
    for line in markdown.splitlines() + [""]:
        if line.lstrip().startswith("```"):
            fenced, block = not fenced, []
            continue
        if fenced:
            continue
        if line.strip():
            block.append(line.strip())
            continue
        text = " ".join(block)
        block = []
        if (len(text) >= MIN_CHARS and not text.startswith(("#", "|", "![", "<", "    "))
                and text.count("|") < 4):
            paragraphs.append(re.sub(r"\s+", " ", text))
    return paragraphs


def extract(root: Path = ROOT) -> dict:
    return {"sources": list(SOURCES), "passages": [
        {"file": name, "text": text} for name in SOURCES
        for text in prose_paragraphs((root / name).read_text())[:MAX_PER_FILE]]}


@functools.lru_cache(maxsize=1)
def passages() -> tuple[str, ...]:
    return tuple(p["text"] for p in json.loads(PASSAGES.read_text())["passages"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.common.chat_texts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"rewrite {PASSAGES.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    data = extract()
    chars = sum(len(p["text"]) for p in data["passages"])
    print(f"{len(data['passages'])} passages, {chars:,} characters, from {', '.join(SOURCES)}")
    if args.write:
        PASSAGES.parent.mkdir(exist_ok=True)
        PASSAGES.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {PASSAGES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
