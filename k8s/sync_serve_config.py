"""Write each Serve config file into its RayService manifest as ``serveConfigV2``, or check that it is there.

    python k8s/sync_serve_config.py           # rewrite the serveConfigV2 blocks (make k8s-config)
    python k8s/sync_serve_config.py --check   # exit 1 if a block differs from its config file

``PAIRS``: configs/gpu-llama.yaml -> k8s/rayservice.yaml, configs/gpu-tp2.yaml -> k8s/rayservice-tp2.yaml. The
config file is the source: it is what `serve run` takes on one machine, and KubeRay takes the same text. It is copied
verbatim (comments too: inside a YAML block scalar they are text), indented under ``serveConfigV2: |``, so the
manifest's value is exactly the file's content.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAIRS = [(ROOT / "configs" / "gpu-llama.yaml", ROOT / "k8s" / "rayservice.yaml"),
         (ROOT / "configs" / "gpu-tp2.yaml", ROOT / "k8s" / "rayservice-tp2.yaml")]
KEY_LINE = "  serveConfigV2: |"  # under `spec:`
INDENT = " " * 4


def render(manifest_text: str, config_text: str) -> str:
    """``manifest_text`` with the block under ``KEY_LINE`` replaced by ``config_text``, indented."""
    lines = manifest_text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip("\n") == KEY_LINE]
    if len(starts) != 1:
        raise ValueError(f"expected one line {KEY_LINE.strip()!r} (indented two spaces) in the manifest, "
                         f"found {len(starts)}")
    start = starts[0] + 1
    end = start  # the block runs while lines are blank or indented deeper than the key
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(INDENT)):
        end += 1
    while end > start and not lines[end - 1].strip():  # trailing blank lines belong to what follows
        end -= 1
    if not config_text.endswith("\n"):
        config_text += "\n"
    block = [INDENT + line if line.strip() else "\n" for line in config_text.splitlines(keepends=True)]
    return "".join(lines[:start] + block + lines[end:])


def sync(config: Path, manifest: Path, check: bool) -> int:
    current = manifest.read_text()
    wanted = render(current, config.read_text())
    if current == wanted:
        print(f"{manifest.name}: serveConfigV2 matches {config.name}")
        return 0
    if check:
        print(f"{manifest}: serveConfigV2 differs from {config}; run `make k8s-config`", file=sys.stderr)
        return 1
    manifest.write_text(wanted)
    print(f"{manifest.name}: serveConfigV2 rewritten from {config.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    parser.add_argument("--config", type=Path, help="one config file (with --manifest) instead of PAIRS")
    parser.add_argument("--manifest", type=Path)
    args = parser.parse_args(argv)
    if (args.config is None) != (args.manifest is None):
        parser.error("--config and --manifest go together")
    pairs = [(args.config, args.manifest)] if args.config is not None else PAIRS
    return max(sync(config, manifest, args.check) for config, manifest in pairs)


if __name__ == "__main__":
    sys.exit(main())
