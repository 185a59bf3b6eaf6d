"""Is a dtype right? The answers of the default model in each dtype, side by
side through ``bulkinfer`` itself: 40 short factual chat questions
(``bench/data/facts.jsonl``: id, prompt, ``expected``, a regular expression
the answer must match), greedy, 32 tokens, with the two likeliest tokens at
each position; then ``bulkinfer eval`` of the 200 golden rows (BLEU, chrF,
ROUGE, the references' perplexity). A dtype is as right as float32 when it
gets as many questions right and the golden scores agree within their
bootstrap intervals; a question whose answer hinges on a near tie (the
smallest gap between the two likeliest tokens over its first ten, in nats)
can flip either way.

Why: the dtype probe (:mod:`bulkinfer.jobs.tune`) scores a reference text's
perplexity; "bfloat16 gave wrong answers on an AMX Xeon" was one chat
question (the capital of France) that this bench shows is a near tie in
float32 itself.

Usage: ``python -m bench.dtype_check [--dtypes float32,bfloat16 --tag T]``;
writes ``bench/results/dtype-check[-T].{json,md}``.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bench.measure import bulkinfer_job, machine, versions
from bulkinfer.io.formats import sibling

ROOT = Path(__file__).resolve().parents[1]
FACTS = ROOT / "bench" / "data" / "facts.jsonl"
GOLDEN = ROOT / "sample_data" / "golden.jsonl"
MARGIN_TOKENS = 10  # the near-tie margin is the smallest over the answer's first tokens
METRICS = ("bleu", "chrf", "rougeL", "perplexity")


def margin(logprobs: list[dict[str, Any]]) -> float:
    """The smallest gap, in nats, between the likeliest and the second
    likeliest token over the first :data:`MARGIN_TOKENS` positions."""
    gaps = []
    for position in logprobs[:MARGIN_TOKENS]:
        top = sorted((t["logprob"] for t in position["top_logprobs"]), reverse=True)
        gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return min(gaps)


def facts(dtype: str, work: Path) -> dict[str, Any]:
    rows = [orjson.loads(line) for line in FACTS.read_bytes().splitlines()]
    src, out = work / "facts.jsonl", work / f"facts-{dtype}.out.jsonl"
    src.write_bytes(b"".join(orjson.dumps({**r, "logprobs": True, "top_logprobs": 2}) + b"\n" for r in rows))
    args = ["run", str(src), "-o", str(out), "--overwrite", "--dtype", dtype, "--temperature", "0",
            "--max-tokens", "32", "--plain-progress"]  # fmt: skip
    measured, report = bulkinfer_job(args, sibling(out, ".report.json"), work / f"facts-{dtype}.log", ROOT)
    answers = {r["id"]: r for r in (orjson.loads(line) for line in out.read_bytes().splitlines())}
    questions = []
    for row in rows:
        answer = answers[row["id"]]
        questions.append({
            "id": row["id"], "prompt": row["prompt"], "expected": row["expected"],
            "answer": answer["completion"], "right": bool(re.search(row["expected"], answer["completion"], re.I)),
            "margin_nats": round(margin(answer["logprobs"]), 3),
        })  # fmt: skip
    return {"questions": questions, "right": sum(q["right"] for q in questions), "seconds": measured.wall_s,
            "engine_dtype": report["engine"]["dtype"]}  # fmt: skip


def golden(dtype: str, work: Path) -> dict[str, Any]:
    out = work / f"golden-{dtype}.out.jsonl"
    args = ["eval", str(GOLDEN), "-o", str(out), "--overwrite", "--engine-arg", f"dtype={dtype}",
            "--temperature", "0", "--perplexity", "--plain-progress"]  # fmt: skip
    _, evaluated = bulkinfer_job(args, sibling(out, ".eval.json"), work / f"golden-{dtype}.log", ROOT)
    return {m: evaluated["scores"][m] for m in METRICS}


def markdown(doc: dict[str, Any]) -> str:
    dtypes = list(doc["dtypes"])

    def row(label: str, cell: Any) -> str:
        return f"| {label} | " + " | ".join(cell(doc["dtypes"][d]) for d in dtypes) + " |"

    lines = [
        f"# bench.dtype_check ({doc['created']})", "",
        f"- Machine: {doc['machine']['cpu']} ({doc['machine']['cpu_kind']}), {doc['machine']['logical_cores']} cores",
        f"- Versions: vllm {doc['versions']['vllm']}, torch {doc['versions']['torch']}",
        f"- Command: `{doc['command']}`", "",
        "| | " + " | ".join(dtypes) + " |", "|---|" + "--:|" * len(dtypes),
        row("factual questions right (of 40)", lambda r: str(r["facts"]["right"])),
        *(row(f"golden {m}", lambda r, m=m: f"{r['golden'][m]:.2f}") for m in METRICS),
        "", "Questions answered differently (right / wrong; the near-tie margin in nats):", "",
        "| question | " + " | ".join(dtypes) + " |", "|---|" + "---|" * len(dtypes),
    ]  # fmt: skip
    by_dtype = {d: {q["id"]: q for q in doc["dtypes"][d]["facts"]["questions"]} for d in dtypes}
    for qid, question in by_dtype[dtypes[0]].items():
        if len({by_dtype[d][qid]["right"] for d in dtypes}) > 1:
            cells = [f"{'right' if by_dtype[d][qid]['right'] else 'wrong'} ({by_dtype[d][qid]['margin_nats']:.2f}): "
                     f"{by_dtype[d][qid]['answer'][:40]!r}" for d in dtypes]  # fmt: skip
            lines.append(f"| {question['prompt']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-dtype-check-"))
    command = "python -m bench.dtype_check" + (f" --dtypes {args.dtypes}" if args.dtypes != "float32,bfloat16" else "")
    doc: dict[str, Any] = {
        "benchmark": "bench.dtype_check", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command + (f" --tag {args.tag}" if args.tag else ""),
        "machine": machine(), "versions": versions(), "dtypes": {},
    }  # fmt: skip
    for dtype in args.dtypes.split(","):
        doc["dtypes"][dtype] = {"facts": facts(dtype, work), "golden": golden(dtype, work)}
    out = ROOT / "bench" / "results" / f"dtype-check{'-' + args.tag if args.tag else ''}.json"
    out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    out.with_suffix(".md").write_text(markdown(doc))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
