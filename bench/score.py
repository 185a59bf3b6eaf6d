"""Pairs/s of ``bulkinfer score`` against sentence-transformers on the same
pairs, the same model directories and this machine: a bi-encoder (the
embedded all-MiniLM-L6-v2) and a cross-encoder of the size of the most used
one (``cross-encoder/ms-marco-MiniLM-L6-v2``: BERT, 6 layers, hidden 384).

No cross-encoder can be downloaded here, so the cross-encoder is built:
all-MiniLM-L6-v2's encoder weights under a one-label classification head
(``BertForSequenceClassification.from_pretrained(dir, num_labels=1)``: the
head is random). Its scores mean nothing; its cost per pair is that of a
MiniLM-L6 cross-encoder, which is what is measured.

The pairs: ShareGPT sample prompts with replies (``sample_data/sharegpt.jsonl``,
each prompt with its own reply and with another's), cycled with a numbered
prefix to ``--pairs`` distinct pairs; both sides cut at the model's limit
(``--truncate``; sentence-transformers' own truncation): 256 tokens per
text for the bi-encoder, 512 per pair for the cross-encoder.

- sentence-transformers: the batch size chosen by timing on the first
  :data:`PROBE_PAIRS` pairs at each of :data:`BATCH_SIZES`, then all pairs
  at the best. Bi-encoder: ``encode`` of both sides and ``util.cos_sim`` of
  each pair; cross-encoder: ``CrossEncoder.predict``. Timed with the model
  loaded (one warm-up batch first).
- bulkinfer: ``bulkinfer score pairs.jsonl -o out.jsonl --truncate
  [--model DIR]`` as a subprocess. Its report's ``throughput.requests_per_s``
  (a row is a pair) covers the engine phase (first request in to last result
  out, tokenizing included); the wall time with the engine start beside it.

Writes ``bench/results/score.json`` and ``score.md``. Run alone on the
machine: ``python -m bench.score`` (``--pairs N`` for a shorter run).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bench.measure import bulkinfer_job, machine, versions

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BATCH_SIZES = (16, 32, 64, 128)
PROBE_PAIRS = 300


def make_pairs(n: int) -> list[tuple[str, str]]:
    """``n`` distinct (prompt, reply) pairs from the ShareGPT sample (see the module docstring)."""
    rows = [orjson.loads(line) for line in (ROOT / "sample_data" / "sharegpt.jsonl").read_bytes().splitlines()]
    rows = [r for r in rows if r.get("prompt") and r.get("reference")]
    base = [(r["prompt"], rows[k if k % 2 == 0 else (k + 1) % len(rows)]["reference"]) for k, r in enumerate(rows)]
    return [(f"{k // len(base)}. {base[k % len(base)][0]}", base[k % len(base)][1]) for k in range(n)]


def make_cross_encoder(encoder_dir: str, path: Path) -> Path:
    """A MiniLM-L6 cross-encoder at ``path``: the encoder's weights, a random one-label head."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(encoder_dir, num_labels=1)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(encoder_dir).save_pretrained(path)
    return path


def best_rate(run: Any, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Pairs/s of ``run(pairs, batch_size)`` at each batch size on a probe, then on all pairs at the best."""
    run(pairs[:64], 32)  # warm-up
    probe = pairs[:PROBE_PAIRS]
    by_batch: dict[int, float] = {}
    for batch_size in BATCH_SIZES:
        started = time.perf_counter()
        run(probe, batch_size)
        by_batch[batch_size] = len(probe) / (time.perf_counter() - started)
        print(f"  sentence-transformers batch {batch_size}: {by_batch[batch_size]:.1f} pairs/s", flush=True)
    best = max(by_batch, key=lambda b: by_batch[b])
    started = time.perf_counter()
    run(pairs, best)
    seconds = time.perf_counter() - started
    return {
        "probe_pairs_per_s_by_batch_size": by_batch,
        "best_batch_size": best,
        "seconds": seconds,
        "pairs_per_s": len(pairs) / seconds,
    }


def bi_encoder_rate(model_dir: str, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """sentence-transformers: ``encode`` both sides, ``util.cos_sim`` of each pair."""
    from sentence_transformers import SentenceTransformer, util

    model = SentenceTransformer(model_dir, device="cpu")

    def run(batch: list[tuple[str, str]], batch_size: int) -> None:
        a = model.encode([p[0] for p in batch], batch_size=batch_size, convert_to_tensor=True)
        b = model.encode([p[1] for p in batch], batch_size=batch_size, convert_to_tensor=True)
        util.pairwise_cos_sim(a, b)

    return {**best_rate(run, pairs), "max_seq_length": model.max_seq_length}


def cross_encoder_rate(model_dir: str, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """sentence-transformers: ``CrossEncoder.predict``."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(model_dir, device="cpu")

    def run(batch: list[tuple[str, str]], batch_size: int) -> None:
        model.predict(batch, batch_size=batch_size)

    return {**best_rate(run, pairs), "max_seq_length": model.max_seq_length}


def bulkinfer_rate(src: Path, work: Path, n: int, model: str | None) -> dict[str, Any]:
    """``bulkinfer score`` on ``src`` as a subprocess; its report's figures."""
    out = work / "out.jsonl"
    args = ["score", str(src), "-o", str(out), "--truncate", "--plain-progress", "--overwrite"]
    args += ["--model", model] if model else []
    measured, report = bulkinfer_job(args, work / "out.report.json", work / "bulkinfer.log", ROOT)
    shown = ["bulkinfer", "score", "pairs.jsonl", "-o", "out.jsonl", "--truncate"]
    return {
        "command": " ".join(shown + (["--model", "DIR"] if model else [])),
        "pairs_per_s": report["throughput"]["requests_per_s"],
        "prompt_tokens_per_s": report["throughput"]["prompt_tokens_per_s"],
        "pairs_per_s_wall": n / measured.wall_s,
        "wall_s": measured.wall_s,
        "seconds": report["seconds"],
        "peak_rss_bytes": measured.peak_rss_bytes,
        "engine": {k: report["engine"].get(k) for k in ("max_num_seqs", "max_num_batched_tokens", "dtype")},
        "scoring": report["scoring"],
    }


def render(doc: dict[str, Any]) -> str:
    """The Markdown summary of one bench run."""
    m = doc["machine"]
    lines = [
        "# bulkinfer score vs sentence-transformers",
        "",
        f"{doc['pairs']:,} ShareGPT prompt/reply pairs (`--truncate`), on {m['cpu']} ({m['logical_cores']} logical "
        f"cores), float32. `python -m bench.score`.",
        "",
        "| model | system | pairs/s | |",
        "| --- | --- | ---: | --- |",
    ]
    for kind, label in (("bi_encoder", "bi-encoder all-MiniLM-L6-v2"), ("cross_encoder", "cross-encoder MiniLM-L6")):
        st, bi = doc[kind]["sentence_transformers"], doc[kind]["bulkinfer"]
        what = "`encode` + `util.pairwise_cos_sim`" if kind == "bi_encoder" else "`CrossEncoder.predict`"
        lines += [
            f"| {label} | sentence-transformers {what}, batch {st['best_batch_size']} | {st['pairs_per_s']:.1f} "
            "| model loaded, scoring only |",
            f"| | `{bi['command']}` | {bi['pairs_per_s']:.1f} | engine phase (report's throughput) |",
            f"| | the same, wall time with the engine start | {bi['pairs_per_s_wall']:.1f} "
            f"| {bi['wall_s']:.1f} s in all |",
            f"| | **ratio, engine phase / sentence-transformers** | **{doc[kind]['ratio']:.2f}x** | |",
        ]
    lines += ["", f"sentence-transformers by batch size (first {PROBE_PAIRS:,} pairs), pairs/s:", ""]
    lines += ["| batch size | bi-encoder | cross-encoder |", "| ---: | ---: | ---: |"]
    for b in BATCH_SIZES:
        bi_rate = doc["bi_encoder"]["sentence_transformers"]["probe_pairs_per_s_by_batch_size"][b]
        ce_rate = doc["cross_encoder"]["sentence_transformers"]["probe_pairs_per_s_by_batch_size"][b]
        lines.append(f"| {b} | {bi_rate:.1f} | {ce_rate:.1f} |")
    for kind in ("bi_encoder", "cross_encoder"):
        bi = doc[kind]["bulkinfer"]
        phases = ", ".join(f"{k} {v:.1f}" for k, v in bi["seconds"].items() if k != "start")
        lines += ["", f"bulkinfer {kind.replace('_', '-')} seconds by phase: {phases}; engine {bi['engine']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1000)
    args = parser.parse_args(argv)
    from bulkinfer.default_model import prepare_default_encoder

    encoder = str(prepare_default_encoder())
    pairs = make_pairs(args.pairs)
    doc: dict[str, Any] = {"pairs": len(pairs), "machine": machine(), "versions": versions()}
    with tempfile.TemporaryDirectory(prefix="bench-score-") as tmp:
        work = Path(tmp)
        cross = str(make_cross_encoder(encoder, work / "minilm-l6-cross-encoder"))
        src = work / "pairs.jsonl"
        src.write_bytes(
            b"".join(orjson.dumps({"id": str(k), "text_1": a, "text_2": b}) + b"\n" for k, (a, b) in enumerate(pairs))
        )
        for kind, model, reference in (
            ("bi_encoder", None, lambda: bi_encoder_rate(encoder, pairs)),
            ("cross_encoder", cross, lambda: cross_encoder_rate(cross, pairs)),
        ):
            print(f"{kind}: bulkinfer score", flush=True)
            ours = bulkinfer_rate(src, work, len(pairs), model)
            print(f"  bulkinfer: {ours['pairs_per_s']:.1f} pairs/s (engine phase)", flush=True)
            print(f"{kind}: sentence-transformers", flush=True)
            theirs = reference()
            doc[kind] = {
                "bulkinfer": ours,
                "sentence_transformers": theirs,
                "ratio": ours["pairs_per_s"] / theirs["pairs_per_s"],
            }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "score.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    (RESULTS / "score.md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
