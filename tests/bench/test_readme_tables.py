"""README.md's generated results tables equal what bench.readme renders from the committed results files.

Every block between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` names its results file on its
last line (``Results file: `PATH`.``); the block is rendered again from that file with
``bench.readme.render_block`` (the one renderer ``python -m bench.readme`` uses) and compared whole.
A block that differs was edited by hand or its file changed: regenerate it with
``python -m bench.readme PATH --marker NAME``.
"""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from bench.readme import markers, render_block

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"<!-- (?P<name>[\w.-]+):start -->\n.*?<!-- (?P=name):end -->", re.S)
RESULTS_FILE = re.compile(r"Results file: `(?P<path>[^`]+)`\.")


def blocks() -> dict[str, str]:
    """README.md's marked blocks by name, each from its start marker to its end marker."""
    found: dict[str, str] = {}
    for match in BLOCK.finditer(README):
        assert match["name"] not in found, f"README.md has two {match['name']} blocks"
        found[match["name"]] = match[0]
    return found


def test_the_readme_has_its_generated_tables() -> None:
    names = set(blocks())
    assert {"bench.compare", "bench.orders", "bench.scale", "bench.defaults-sharegpt", "bench.faults"} <= names
    for name in names:  # every start marker has its end marker (BLOCK would skip an unclosed one)
        start, end = markers(name)
        assert README.count(start) == README.count(end) == 1


@pytest.mark.parametrize("name", sorted(blocks()))
def test_a_marked_block_is_its_results_file_rendered(name: str) -> None:
    block = blocks()[name]
    named = RESULTS_FILE.findall(block)
    assert len(named) == 1, f"block {name} should name one results file, names {named}"
    path = named[0]
    doc = orjson.loads((ROOT / path).read_bytes())
    assert block == render_block(doc, name, path), (
        f"README.md's {name} block is not its results file rendered: "
        f"run `python -m bench.readme {path} --marker {name}`"
    )


def test_every_results_file_the_readme_names_is_in_the_repository() -> None:
    named = RESULTS_FILE.findall(README)
    assert named
    missing = [path for path in named if not (ROOT / path).is_file()]
    assert not missing, f"README.md names results files that are not in the repository: {missing}"


def expand(cited: str) -> list[str]:
    """A cited path with its ``{a,b}`` alternatives spelt out: ``x.{json,md}`` -> ``x.json``, ``x.md``."""
    braces = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", cited)
    return [f"{braces[1]}{alt}{braces[3]}" for alt in braces[2].split(",")] if braces else [cited]


def test_every_bench_results_path_the_readmes_cite_exists() -> None:
    """``bench/results/...`` anywhere in README.md, bench/README.md or docs/*.md; ``*`` must match a file."""
    missing = []
    for page in (ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for cited in re.findall(r"bench/results/[\w.{},*/-]+", page.read_text(encoding="utf-8")):
            for path in expand(cited.rstrip(".,")):
                if path.endswith("-"):  # a name pattern in prose: `compare-<workload>-n<N>-...`
                    continue
                if not (any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                    missing.append(f"{page.name}: {path}")
    assert not missing, f"cited results that are not in the repository: {missing}"
