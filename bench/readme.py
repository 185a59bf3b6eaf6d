"""Put a benchmark's results page into README.md, between its markers.

Usage: python -m bench.readme RESULTS.json [--marker NAME] [--readme README.md]

Replaces what stands between the markers ``<!-- NAME:start -->`` and
``<!-- NAME:end -->`` with the run's rendered page (bench.table for
``bench.compare`` results, bench.scale.render for ``bench.scale``,
bench.faults.render for ``bench.faults``), so the README's numbers always come
from a committed results file. NAME defaults to the file's ``benchmark`` field
(faults.json has none: ``--marker bench.faults``); the feed-order runs use
``--marker bench.orders``.
``tests/bench/test_readme_tables.py`` renders every marked block of README.md
again with ``render_block`` and checks that the README holds exactly that.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bench import faults, scale, table

# Results pages by benchmark; bench.compare's (bench.table) for any other.
RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {"bench.scale": scale.render, "bench.faults": faults.render}


def markers(name: str) -> tuple[str, str]:
    """The start and end marker lines of block ``name``: ``<!-- NAME:start -->``, ``<!-- NAME:end -->``."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def render_block(doc: dict[str, Any], marker: str, results_path: Path | str) -> str:
    """The README block ``marker`` for the results ``doc`` read from ``results_path``, markers included.

    The page is the renderer's in :data:`RENDERERS` for the document's ``benchmark`` (else the
    marker's name: faults.json names none), bench.table.render's (``bench.compare``) otherwise,
    a level-1 title demoted to level 4, followed by the line ``Results file: `RESULTS_PATH`.``;
    ``results_path`` is written as given (repository-relative in README.md). Raises KeyError when
    ``doc`` lacks a field its renderer reads.
    """
    page = RENDERERS.get(doc.get("benchmark", marker), table.render)(doc)
    if page.startswith("# "):
        page = "####" + page[1:]
    body = page.rstrip("\n")
    start, end = markers(marker)
    return f"{start}\n{body}\n\nResults file: `{results_path}`.\n{end}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--marker", default=None)
    parser.add_argument("--readme", type=Path, default=Path("README.md"))
    args = parser.parse_args(argv)
    doc = orjson.loads(args.results.read_bytes())
    marker = args.marker or doc.get("benchmark")
    if marker is None:
        raise SystemExit(f"{args.results} names no benchmark: give --marker")
    start, end = markers(marker)
    text = args.readme.read_text(encoding="utf-8")
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    if not rest:
        raise SystemExit(f"{args.readme} has no {start} marker")
    args.readme.write_text(f"{head}{render_block(doc, marker, args.results)}{tail}", encoding="utf-8")


if __name__ == "__main__":
    main()
