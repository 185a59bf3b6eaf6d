"""Write ``sample_data/pairs.jsonl`` and ``sample_data/rerank.jsonl``, the
``bulkinfer score`` samples, from ``sample_data/golden.jsonl`` (held-out
ShareGPT prompts with their first replies, ``reference``).

- ``pairs.jsonl``: 100 pair rows ``{"id": "pair-<k>", "text_1", "text_2",
  "matched"}`` from golden rows 0-99: ``text_1`` row k's prompt, ``text_2``
  its own reply when k is even (``matched`` true), else row k+1's.
- ``rerank.jsonl``: 20 rerank rows ``{"id": "rerank-<i>", "query",
  "documents", "relevant", "top_n"?}`` from golden rows 100-199: the query
  row 100+5i's prompt, the documents the replies of rows 100+5i .. 100+5i+4
  rotated so the query's own reply sits at position i % 5 (``relevant``:
  ``[i % 5]``, for a ranking evaluation); every other row asks for
  ``top_n`` 3.
- ``openai_score.jsonl``: OpenAI-style batch lines with vLLM's scoring
  bodies: a ``/v1/score`` line scoring one query against three replies
  (1:N), a ``/v1/score`` line of two pairs (N:N), a ``/v1/rerank`` line
  with ``top_n`` 2, from golden rows 40-44.

Running it again gives byte-identical files: ``python -m bench.score_data``.
"""

from __future__ import annotations

from pathlib import Path

import orjson

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data"


def main() -> None:
    golden = [orjson.loads(line) for line in (SAMPLE / "golden.jsonl").read_bytes().splitlines() if line.strip()]
    pairs = [
        {
            "id": f"pair-{k}",
            "text_1": golden[k]["prompt"],
            "text_2": golden[k if k % 2 == 0 else k + 1]["reference"],
            "matched": k % 2 == 0,
        }
        for k in range(100)
    ]
    rerank = []
    for i in range(20):
        group = golden[100 + 5 * i : 105 + 5 * i]
        shift = i % 5
        replies = [row["reference"] for row in group]
        documents = replies[-shift:] + replies[:-shift] if shift else replies  # the own reply (index 0) at `shift`
        row = {"id": f"rerank-{i}", "query": group[0]["prompt"], "documents": documents, "relevant": [shift]}
        rerank.append(row | ({"top_n": 3} if i % 2 else {}))
    near = golden[40:45]
    lines = [
        _openai(
            "score-1n", "/v1/score", {"queries": near[0]["prompt"], "documents": [r["reference"] for r in near[:3]]}
        ),
        _openai(
            "score-nn",
            "/v1/score",
            {"text_1": [near[3]["prompt"], near[4]["prompt"]], "text_2": [near[3]["reference"], near[3]["reference"]]},
        ),
        _openai(
            "rerank-top2",
            "/v1/rerank",
            {"query": near[4]["prompt"], "documents": [r["reference"] for r in near[2:5]], "top_n": 2},
        ),
    ]
    for name, rows in (("pairs.jsonl", pairs), ("rerank.jsonl", rerank), ("openai_score.jsonl", lines)):
        (SAMPLE / name).write_bytes(b"".join(_line(r) for r in rows))


def _openai(custom_id: str, url: str, body: dict[str, object]) -> dict[str, object]:
    """An OpenAI-style batch line for ``url`` with ``body`` (and the model named, as a client sends it)."""
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "all-minilm-l6-v2", **body}}


def _line(row: dict[str, object]) -> bytes:
    """One JSONL line as the other sample files have them: UTF-8, with U+0085, U+2028 and U+2029 as \\u escapes."""
    text = orjson.dumps(row).decode()
    for char in ("\u0085", "\u2028", "\u2029"):
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text.encode() + b"\n"


if __name__ == "__main__":
    main()
