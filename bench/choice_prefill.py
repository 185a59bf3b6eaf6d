"""What vLLM prefills for a request of ``n`` choices: each child request's
prompt, its whole blocks from the prefix cache once a sibling has them.

``python -m bench.choice_prefill [--rows 12] [--n 4] [--tag T]`` runs
``bulkinfer.run`` in this process (its defaults, ``max_tokens`` 8) on
``--rows`` ShareGPT prompts (``sample_data/sharegpt.jsonl`` from row 100
on, as :mod:`bench.eta_choices`), each with ``"n": N``, and notes the first
output of each choice as vLLM streams it (``RequestOutputKind.DELTA``: one
``RequestOutput`` a child, with that child's ``num_cached_tokens``): its
prompt tokens, its cached tokens and when it came. Writes
``bench/results/choice-prefill-T.{json,md}``: per row and in all, the
prompt tokens over the choices, those from the cache, and the prompt
tokens counted once a request (what the engine's ``prefilled_tokens``
counted before it counted each choice).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.eta_choices import write_rows
from bench.measure import runs_doc, write_page


def measure(rows: int, n: int) -> tuple[list[dict[str, Any]], int]:
    """Each row's choices' first outputs (``[{request_id, prompt_tokens,
    choices: [[index, cached tokens, seconds after the row's first]]}]``,
    the longest prompt first) and the engine's block size (tokens)."""
    import bulkinfer.engine.sampling as sampling
    from bulkinfer import load_settings, run

    seen: dict[tuple[str, int], tuple[int, int, float]] = {}
    completions = sampling.StreamedOutputs.completions

    def noted(self: Any, outputs: Any) -> Any:
        for out in outputs:
            for piece in out.outputs if isinstance(out.outputs, list) else ():
                key = (out.request_id, piece.index)
                if key not in seen:
                    seen[key] = (len(out.prompt_token_ids or ()), out.num_cached_tokens or 0, time.monotonic())
        return completions(self, outputs)

    sampling.StreamedOutputs.completions = noted  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        write_rows(src, rows, n)
        settings = load_settings(overrides={"sampling.max_tokens": 8})
        result = run(src, Path(tmp) / "out.jsonl", settings=settings, overwrite=True)
    by_row: dict[str, list[tuple[int, int, int, float]]] = {}
    for (request_id, index), (prompt, cached, at) in seen.items():
        by_row.setdefault(request_id, []).append((index, prompt, cached, at))
    out = []
    for request_id, choices in by_row.items():
        choices.sort(key=lambda c: c[3])
        first = choices[0][3]
        out.append(
            {
                "request_id": request_id,
                "prompt_tokens": choices[0][1],
                "choices": [[index, cached, round(at - first, 3)] for index, _, cached, at in choices],
            }
        )
    return sorted(out, key=lambda r: -r["prompt_tokens"]), result.report["engine"]["block_size"]


def render(doc: dict[str, Any]) -> str:
    m, t = doc["machine"], doc["totals"]
    lines = [
        f"# The prompt tokens of rows of n choices ({doc['created']}; {m['cpu']} ({m['cpu_kind']}), "
        f"{m['logical_cores']} cores)",
        "",
        f"Command: `{doc['command']}`; {doc['rows']} ShareGPT prompts, `n` {doc['n']}, vLLM "
        f"{doc['versions'].get('vllm')}, block size {doc['block_size']}. In all: {t['prompt_tokens']:,} prompt tokens "
        f"over the choices, {t['cached_tokens']:,} of them from the prefix cache ({t['computed_tokens']:,} computed), "
        f"against {t['once_a_request']:,} counted once a request.",
        "",
        "| row | prompt tokens | each choice: cached tokens (s after the first) |",
        "| --- | ---: | --- |",
    ]
    for r in doc["runs"]:
        each = ", ".join(f"{cached} ({at:.2f})" for _, cached, at in r["choices"])
        lines.append(f"| {r['request_id']} | {r['prompt_tokens']} | {each} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tag", default="choices")
    args = parser.parse_args()
    rows, block = measure(args.rows, args.n)
    prompt = sum(r["prompt_tokens"] * len(r["choices"]) for r in rows)
    cached = sum(c[1] for r in rows for c in r["choices"])
    totals = {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": prompt - cached,
        "once_a_request": sum(r["prompt_tokens"] for r in rows),
    }
    doc = {**runs_doc("bench.choice_prefill", rows), "rows": args.rows, "n": args.n, "block_size": block}
    write_page(f"choice-prefill-{args.tag}", {**doc, "totals": totals}, render)


if __name__ == "__main__":
    main()
