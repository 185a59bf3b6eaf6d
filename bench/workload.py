"""Workloads for `bench.compare`: the same rows, token counts and `max_tokens` for every system.

A workload is a list of :class:`Row`: the prompt text, its token ids (the
model's tokenizer, ``tokenizer(prompt).input_ids``, as vLLM's ShareGPT
benchmark and bulkinfer's planner tokenize a plain prompt) and the number of
completion tokens every system must produce for it (``max_tokens``, generated
with ``ignore_eos``).

- ``sharegpt``: the first N rows of ``sample_data/sharegpt.jsonl`` (ShareGPT
  first turns already passed through vLLM's filter: prompt 4..1024 tokens,
  prompt + reply <= 2048; shuffled with seed 0, see ``sample_data/README.md``).
  ``max_tokens`` = the reply's length in tokens (``reference_tokens``), capped
  so that prompt + output <= 2048.
- ``fixed``: N prompts of exactly 128 tokens (random common words, seeded),
  64 completion tokens each: a control where feed order should not matter.
- ``shared-prefix``: the first N rows of ``sample_data/sharegpt_multiturn.jsonl``
  (real ShareGPT conversations replayed turn by turn: row k of a
  conversation is its messages up to the k-th user turn, so it starts with
  row k - 1's prompt; see ``bench/multiturn_data.py``), each rendered with
  the model's chat template (generation prompt appended) into the prompt
  text, then shuffled with ``random.Random(seed)``. ``max_tokens`` = the
  reference reply's length, capped as ``sharegpt``'s.

``max_output`` caps every row's ``max_tokens`` (tiny test runs).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
SHAREGPT = ROOT / "sample_data" / "sharegpt.jsonl"
SHAREGPT_MULTITURN = ROOT / "sample_data" / "sharegpt_multiturn.jsonl"
MAX_TOTAL_TOKENS = 2048  # vLLM's ShareGPT filter: prompt + output <= 2048
FIXED_PROMPT_TOKENS = 128
FIXED_OUTPUT_TOKENS = 64
# Each of these is one token after a space for SmolLM2's tokenizer (checked when building).
WORDS = "the of and to in is for on that with as by at from this be are it an or was".split()
PASSTHROUGH_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""A chat template that renders the user message's text as is: run-batch only serves
``/v1/chat/completions``, and this keeps its prompt tokens equal to the other systems'."""


@dataclass(frozen=True, slots=True)
class Row:
    """One request: ``prompt_token_ids`` is the prompt as every system sees it,
    ``max_tokens`` the completion tokens every system generates for it."""

    id: str
    prompt: str
    prompt_token_ids: list[int]
    max_tokens: int


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def sharegpt_rows(tokenizer: Any, n: int, max_output: int | None = None, path: Path = SHAREGPT) -> list[Row]:
    """The first ``n`` rows of ``path``; raises ValueError when it holds fewer."""
    return _reference_rows(tokenizer, n, max_output, path, lambda record: record["prompt"])


def shared_prefix_rows(
    tokenizer: Any, n: int, max_output: int | None = None, seed: int = 0, path: Path = SHAREGPT_MULTITURN
) -> list[Row]:
    """The first ``n`` rows of ``path`` (whole conversations first: the file
    holds them one after another), chat-templated, shuffled with ``seed``;
    raises ValueError when it holds fewer."""

    def render(record: dict[str, Any]) -> str:
        return str(tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True))

    rows = _reference_rows(tokenizer, n, max_output, path, render)
    random.Random(seed).shuffle(rows)
    return rows


def _reference_rows(
    tokenizer: Any, n: int, max_output: int | None, path: Path, prompt_of: Callable[[dict[str, Any]], str]
) -> list[Row]:
    """The first ``n`` records of ``path`` as rows: ``prompt_of(record)``
    tokenized, ``max_tokens`` from its ``reference_tokens`` (:func:`_max_tokens`)."""
    rows: list[Row] = []
    with open(path, "rb") as f:
        for line in f:
            if len(rows) == n:
                break
            record = orjson.loads(line)
            prompt = prompt_of(record)
            ids = list(tokenizer(prompt).input_ids)
            rows.append(Row(str(record["id"]), prompt, ids, _max_tokens(record, len(ids), max_output)))
    if len(rows) < n:
        raise ValueError(f"{path} holds {len(rows)} rows, fewer than --n {n}")
    return rows


def _max_tokens(record: dict[str, Any], prompt_tokens: int, max_output: int | None) -> int:
    """The reference reply's length, so that prompt + output <= 2048, and at most ``max_output``."""
    max_tokens = min(int(record["reference_tokens"]), MAX_TOTAL_TOKENS - prompt_tokens)
    return max_tokens if max_output is None else min(max_tokens, max_output)


def fixed_rows(tokenizer: Any, n: int, max_output: int | None = None, seed: int = 0) -> list[Row]:
    """``n`` prompts of exactly 128 tokens with 64 completion tokens each."""
    rng = random.Random(seed)
    max_tokens = FIXED_OUTPUT_TOKENS if max_output is None else min(FIXED_OUTPUT_TOKENS, max_output)
    rows = []
    for i in range(n):
        prompt = " ".join(rng.choices(WORDS, k=FIXED_PROMPT_TOKENS))
        ids = list(tokenizer(prompt).input_ids)
        if len(ids) != FIXED_PROMPT_TOKENS:
            raise ValueError(f"fixed prompt {i} is {len(ids)} tokens, not {FIXED_PROMPT_TOKENS}: another tokenizer?")
        rows.append(Row(f"fixed-{i}", prompt, ids, max_tokens))
    return rows


def build(name: str, tokenizer: Any, n: int, max_output: int | None = None, seed: int = 0) -> list[Row]:
    if name == "sharegpt":
        return sharegpt_rows(tokenizer, n, max_output)
    if name == "fixed":
        return fixed_rows(tokenizer, n, max_output, seed)
    if name == "shared-prefix":
        return shared_prefix_rows(tokenizer, n, max_output, seed)
    raise ValueError(f"unknown workload {name!r}")


def static_subset(rows: Sequence[Row], k: int, max_total: int | None) -> list[Row]:
    """The static baseline's rows: the first ``k`` rows (``k`` <= 0: all) whose
    prompt + ``max_tokens`` is at most ``max_total`` tokens (None: no limit), in
    arrival order. A length limit keeps the slow baseline inside the benchmark's
    time budget; it favours that baseline (its cost per step grows with the
    padded length), so it never flatters the vLLM systems."""
    fits = [r for r in rows if max_total is None or len(r.prompt_token_ids) + r.max_tokens <= max_total]
    return fits if k <= 0 else fits[:k]


def describe(rows: Sequence[Row]) -> dict[str, Any]:
    """Row count and prompt / output token statistics."""
    prompt = [len(r.prompt_token_ids) for r in rows]
    output = [r.max_tokens for r in rows]
    return {
        "rows": len(rows),
        "prompt_tokens": sum(prompt),
        "completion_tokens": sum(output),
        "prompt_tokens_min_mean_max": [min(prompt), sum(prompt) / len(prompt), max(prompt)],
        "completion_tokens_min_mean_max": [min(output), sum(output) / len(output), max(output)],
    }


def _write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))


def write_bulkinfer_input(rows: Sequence[Row], path: Path) -> None:
    """bulkinfer input rows: ``id``, ``prompt`` and the row's own ``max_tokens``."""
    _write_jsonl(path, [{"id": r.id, "prompt": r.prompt, "max_tokens": r.max_tokens} for r in rows])


def write_openai_batch(rows: Sequence[Row], path: Path, model: str, temperature: float, top_p: float) -> None:
    """OpenAI batch request lines for ``vllm run-batch`` (``/v1/chat/completions``,
    the only text-generation endpoint it serves). ``ignore_eos`` and
    ``add_special_tokens`` are vLLM extensions of the request schema; with
    :data:`PASSTHROUGH_CHAT_TEMPLATE` the prompt tokens are ``tokenizer(prompt).input_ids``."""
    _write_jsonl(
        path,
        [
            {
                "custom_id": r.id,
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": r.prompt}],
                    "max_completion_tokens": r.max_tokens,
                    "temperature": temperature,
                    "top_p": top_p,
                    "ignore_eos": True,
                    "add_special_tokens": True,
                },
            }
            for r in rows
        ],
    )


def write_token_rows(rows: Sequence[Row], path: Path) -> None:
    """Rows for the in-process workers (raw vLLM, transformers)."""
    _write_jsonl(
        path,
        [
            {"id": r.id, "prompt": r.prompt, "prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
            for r in rows
        ],
    )


def read_token_rows(path: Path) -> list[Row]:
    return [Row(**orjson.loads(line)) for line in path.read_bytes().splitlines() if line.strip()]


def static_batches(rows: Sequence[Row], batch_size: int, max_total: int = MAX_TOTAL_TOKENS) -> list[list[Row]]:
    """Cut ``rows``, in the given order, into static batches as vLLM's ``hf``
    benchmark backend does (``_run_hf_requests`` in vllm/benchmarks/throughput.py):
    a batch closes at ``batch_size`` rows, at the last row, or when adding the
    next row would make longest prompt + longest output exceed ``max_total``."""
    batches: list[list[Row]] = []
    batch: list[Row] = []
    max_prompt = max_output = 0
    for i, row in enumerate(rows):
        batch.append(row)
        max_prompt = max(max_prompt, len(row.prompt_token_ids))
        max_output = max(max_output, row.max_tokens)
        if len(batch) < batch_size and i != len(rows) - 1:
            nxt = rows[i + 1]
            if max(max_prompt, len(nxt.prompt_token_ids)) + max(max_output, nxt.max_tokens) <= max_total:
                continue
        batches.append(batch)
        batch = []
        max_prompt = max_output = 0
    return batches


def padding_efficiency(batches: Sequence[Sequence[Row]]) -> dict[str, float | int]:
    """Static batches pad prompts to the batch's longest and generate the batch's
    longest output for every row. ``prompt`` = real / padded prompt positions;
    ``completion`` = requested completion tokens / generated positions."""
    real_p = sum(len(r.prompt_token_ids) for b in batches for r in b)
    padded_p = sum(len(b) * max(len(r.prompt_token_ids) for r in b) for b in batches)
    real_c = sum(r.max_tokens for b in batches for r in b)
    padded_c = sum(len(b) * max(r.max_tokens for r in b) for b in batches)
    return {
        "batches": len(batches),
        "prompt": real_p / padded_p if padded_p else 1.0,
        "completion": real_c / padded_c if padded_c else 1.0,
    }
