"""Put a `bench.compare` results table into README.md's Performance section.

Usage: python -m bench.readme bench/results/compare-sharegpt-n200-<time>.json

Replaces what stands between the markers ``<!-- bench.compare:start -->`` and
``<!-- bench.compare:end -->`` with the run's rendered page (bench.table), so the
README's numbers always come from a committed results file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from bench.table import render

START, END = "<!-- bench.compare:start -->", "<!-- bench.compare:end -->"


def main() -> None:
    results = Path(sys.argv[1])
    readme = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("README.md")
    page = render(orjson.loads(results.read_bytes()))
    body = page.replace("# bench.compare", "#### bench.compare", 1)
    block = f"{START}\n{body}\nResults file: `{results}`.\n{END}"
    text = readme.read_text(encoding="utf-8")
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"{readme} has no {START} marker")
    readme.write_text(head + block + tail, encoding="utf-8")


if __name__ == "__main__":
    main()
