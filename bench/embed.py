"""Texts/s of ``bulkinfer embed`` against sentence-transformers' ``encode``
on the same 10,000 texts, the same model directory (the embedded
all-MiniLM-L6-v2) and this machine.

The texts: the sentences of ``sample_data/sharegpt.jsonl`` (prompts and
references, split at line breaks and sentence ends, at least 20 characters),
cycled with a numbered prefix to 10,000 distinct texts. Both sides cut a
text at the model's ``max_seq_length`` (256 tokens): ``--truncate``, and
sentence-transformers' own truncation.

- sentence-transformers: ``SentenceTransformer(dir, device="cpu")``, the
  batch size chosen by timing ``encode`` on the first 2,000 texts at each of
  :data:`BATCH_SIZES`; then the 10,000 at the best. Timed: ``encode`` alone
  (model loaded, one warm-up batch first).
- bulkinfer: ``bulkinfer embed texts.jsonl -o out.parquet --truncate`` as a
  subprocess. Its report's ``throughput.requests_per_s`` covers the engine
  phase (first request in to last result out: tokenizing the windows
  included, the engine start and the Parquet publish not); the wall time
  with the engine start is given beside it.

Writes ``bench/results/embed.json`` and ``embed.md``. Run alone on the
machine: ``python -m bench.embed`` (``--texts N`` for a shorter run;
``--samples`` writes ``sample_data/texts.jsonl`` and ``openai_embeddings.jsonl``).
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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BATCH_SIZES = (16, 32, 64, 128, 256)
PROBE_TEXTS = 2000


def make_texts(n: int) -> list[str]:
    """``n`` distinct texts from the ShareGPT sample's sentences (see the module docstring)."""
    sentences: list[str] = []
    for line in (ROOT / "sample_data" / "sharegpt.jsonl").read_bytes().splitlines():
        row = orjson.loads(line)
        for field in ("prompt", "reference"):
            for piece in re.split(r"(?<=[.!?])\s+|\n+", str(row.get(field) or "")):
                if len(piece.strip()) >= 20:
                    sentences.append(piece.strip())
    return [f"{k // len(sentences)}. {sentences[k % len(sentences)]}" for k in range(n)]


def sentence_transformers_rate(model_dir: str, texts: list[str]) -> dict[str, Any]:
    """Texts/s of ``encode`` at each batch size on a probe, then on all ``texts`` at the best."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    model.encode(texts[:64], batch_size=32)  # warm-up
    probe = texts[:PROBE_TEXTS]
    by_batch: dict[int, float] = {}
    for batch_size in BATCH_SIZES:
        started = time.perf_counter()
        model.encode(probe, batch_size=batch_size)
        by_batch[batch_size] = len(probe) / (time.perf_counter() - started)
        print(f"sentence-transformers batch {batch_size}: {by_batch[batch_size]:.1f} texts/s", flush=True)
    best = max(by_batch, key=lambda b: by_batch[b])
    started = time.perf_counter()
    model.encode(texts, batch_size=best)
    seconds = time.perf_counter() - started
    return {
        "probe_texts_per_s_by_batch_size": by_batch,
        "best_batch_size": best,
        "seconds": seconds,
        "texts_per_s": len(texts) / seconds,
        "max_seq_length": model.max_seq_length,
        "torch_threads": _torch_threads(),
    }


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def bulkinfer_rate(src: Path, work: Path, n: int) -> dict[str, Any]:
    """``bulkinfer embed`` on ``src`` as a subprocess; its report's figures."""
    out = work / "out.parquet"
    args = ["embed", str(src), "-o", str(out), "--truncate", "--plain-progress"]
    measured, report = bulkinfer_job(args, work / "out.report.json", work / "bulkinfer.log", ROOT)
    return {
        "command": " ".join(["bulkinfer", *args]),
        "texts_per_s": report["throughput"]["requests_per_s"],
        "prompt_tokens_per_s": report["throughput"]["prompt_tokens_per_s"],
        "texts_per_s_wall": n / measured.wall_s,
        "wall_s": measured.wall_s,
        "seconds": report["seconds"],
        "peak_rss_bytes": measured.peak_rss_bytes,
        "engine": {k: report["engine"].get(k) for k in ("max_num_seqs", "max_num_batched_tokens", "dtype")},
        "embedding": report["embedding"],
    }


def render(doc: dict[str, Any]) -> str:
    """The Markdown summary of one bench run."""
    st, bi, m = doc["sentence_transformers"], doc["bulkinfer"], doc["machine"]
    rows = "\n".join(f"| {b} | {r:.1f} |" for b, r in st["probe_texts_per_s_by_batch_size"].items())
    return f"""# bulkinfer embed vs sentence-transformers encode

{doc["texts"]:,} texts (ShareGPT sample sentences, cut at 256 tokens), all-MiniLM-L6-v2 (float32),
on {m["cpu"]} ({m["logical_cores"]} logical cores). `python -m bench.embed`.

| system | texts/s | |
| --- | ---: | --- |
| sentence-transformers `encode`, batch {st["best_batch_size"]} | {st["texts_per_s"]:.1f} | model loaded, encode only |
| `{bi["command"]}` | {bi["texts_per_s"]:.1f} | engine phase (report's throughput) |
| the same, wall time with the engine start | {bi["texts_per_s_wall"]:.1f} | {bi["wall_s"]:.1f} s in all |

Ratio (bulkinfer engine phase / sentence-transformers): **{doc["ratio"]:.2f}x**.

sentence-transformers by batch size (first {PROBE_TEXTS:,} texts):

| batch size | texts/s |
| ---: | ---: |
{rows}

bulkinfer's seconds by phase: {", ".join(f"{k} {v:.1f}" for k, v in bi["seconds"].items() if k != "start")};
engine {bi["engine"]}.
"""


# sample_data/openai_embeddings.jsonl: OpenAI /v1/embeddings lines (a string, a list, base64)
OPENAI_SAMPLE = (
    ("emb-1", {"input": "How do I sort a list of dictionaries by a key in Python?"}),
    ("emb-2", {"input": ["The cat sat on the mat.", "A cat was sitting on a mat.", "Quarterly revenue rose by 12%."]}),
    ("emb-3", {"input": "Explain vector search in one paragraph.", "encoding_format": "base64"}),
)


def write_samples() -> None:
    """``sample_data/texts.jsonl`` (the 300 ShareGPT prompts as ``id`` + ``text``
    rows) and ``sample_data/openai_embeddings.jsonl``, with the samples' own
    JSONL writer (``extract_sharegpt.write_jsonl``)."""
    from bench.newcomer_data import SAMPLE_DATA, load_extract

    ex = load_extract()
    rows = [orjson.loads(line) for line in (SAMPLE_DATA / "sharegpt.jsonl").read_bytes().splitlines()]
    ex.write_jsonl(SAMPLE_DATA / "texts.jsonl", [{"id": r["id"], "text": r["prompt"]} for r in rows])
    lines = [
        {"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": {"model": "all-minilm-l6-v2", **body}}
        for cid, body in OPENAI_SAMPLE
    ]
    ex.write_jsonl(SAMPLE_DATA / "openai_embeddings.jsonl", lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=10_000)
    parser.add_argument("--samples", action="store_true", help="only write the embedding samples of sample_data/")
    args = parser.parse_args(argv)
    if args.samples:
        write_samples()
        return
    from bulkinfer.default_model import prepare_default_encoder

    model_dir = str(prepare_default_encoder())
    texts = make_texts(args.texts)
    with tempfile.TemporaryDirectory(prefix="bench-embed-") as tmp:
        work = Path(tmp)
        src = work / "texts.jsonl"
        src.write_bytes(b"".join(orjson.dumps({"id": str(k), "text": t}) + b"\n" for k, t in enumerate(texts)))
        ours = bulkinfer_rate(src, work, len(texts))
        print(f"bulkinfer embed: {ours['texts_per_s']:.1f} texts/s", flush=True)
        theirs = sentence_transformers_rate(model_dir, texts)
        print(f"sentence-transformers: {theirs['texts_per_s']:.1f} texts/s", flush=True)
    doc = {
        "texts": len(texts),
        "machine": machine(),
        "versions": versions(),
        "bulkinfer": ours,
        "sentence_transformers": theirs,
        "ratio": ours["texts_per_s"] / theirs["texts_per_s"],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "embed.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    (RESULTS / "embed.md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
