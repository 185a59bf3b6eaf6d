"""Put a benchmark's results page into README.md's Performance section.

Usage: python -m bench.readme RESULTS.json [--marker NAME] [--readme README.md]

Replaces what stands between the markers ``<!-- NAME:start -->`` and
``<!-- NAME:end -->`` with the run's rendered page (bench.table for
``bench.compare`` results, bench.scale.render for ``bench.scale``), so the
README's numbers always come from a committed results file. NAME defaults to
the file's ``benchmark`` field; the feed-order runs use ``--marker bench.orders``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson

from bench import scale, table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--marker", default=None)
    parser.add_argument("--readme", type=Path, default=Path("README.md"))
    args = parser.parse_args(argv)
    doc = orjson.loads(args.results.read_bytes())
    marker = args.marker or doc["benchmark"]
    page = scale.render(doc) if doc["benchmark"] == "bench.scale" else table.render(doc)
    body = page.replace(f"# {doc['benchmark']}", f"#### {doc['benchmark']}", 1).rstrip("\n")
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    text = args.readme.read_text(encoding="utf-8")
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    if not rest:
        raise SystemExit(f"{args.readme} has no {start} marker")
    args.readme.write_text(f"{head}{start}\n{body}\n\nResults file: `{args.results}`.\n{end}{tail}", encoding="utf-8")


if __name__ == "__main__":
    main()
