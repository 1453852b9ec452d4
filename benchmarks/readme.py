"""Paste the generated benchmark section into the README.

``python -m benchmarks.readme`` replaces the README's ``## Benchmark results`` section (up to the
next ``## `` heading) with ``benchmarks/results/README_section.md``, which
``python -m benchmarks.run --readme`` writes; ``--check`` only reports whether they differ (exit 1).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from partitioner.core.files import write_atomic

REPO = Path(__file__).resolve().parent.parent
SECTION = REPO / "benchmarks" / "results" / "README_section.md"
HEADING = "## Benchmark results"


def pasted(readme: str, section: str) -> str:
    """``readme`` with its benchmark section replaced by ``section``."""
    start = readme.index(HEADING)
    end = readme.find("\n## ", start + len(HEADING))
    tail = readme[end + 1 :] if end >= 0 else ""
    return readme[:start] + section.rstrip("\n") + "\n\n" + tail


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.readme", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    args = parser.parse_args(argv)
    readme_path = REPO / "README.md"
    readme = readme_path.read_text(encoding="utf-8")
    new = pasted(readme, SECTION.read_text(encoding="utf-8"))
    if args.check:
        if new != readme:
            sys.stderr.write("README's benchmark section differs from the generated one\n")
            return 1
        return 0
    if new != readme:
        write_atomic(readme_path, new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
