"""``bulkinfer embed`` end to end: the real CLI, vLLM's pooling runner and the
embedded all-MiniLM-L6-v2. One job embeds 200 ShareGPT prompts with OpenAI
/v1/embeddings lines among them, then 1,200 more rows: its first run is
killed with SIGKILL mid-run and ``--resume`` finishes it (every id once);
the finished output is checked for fidelity against sentence-transformers,
the OpenAI line types and base64. (The Parquet vector column is checked with
a fake encoder in tests/jobs/test_embed_job.py.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from reference_types import check_embeddings_line, decode_base64

from bulkinfer.default_model import prepare_default_encoder
from bulkinfer.io.spool import spool_records

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "sample_data"
DIM = 384


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[Any]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def command(src: Path, out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "bulkinfer", "embed", str(src), "-o", str(out), "--plain-progress", *flags]


def texts(n: int) -> list[dict[str, str]]:
    return [{"id": r["id"], "text": r["prompt"]} for r in read_jsonl(SAMPLE / "sharegpt.jsonl")[:n]]


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/embeddings") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


EXTRA = [{"id": f"{r['id']}-{k}", "text": r["text"]} for k in range(4) for r in texts(300)]


def many_ids() -> list[list[int]]:
    """The "many" line's three texts as the encoder's tokenizer gives them ([CLS] ... [SEP] each)."""
    from bulkinfer.models import load_tokenizer

    tokenizer = load_tokenizer(str(prepare_default_encoder()))
    return [list(ids) for ids in tokenizer(["first text", "second text", "third"])["input_ids"]]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One job: 200 ShareGPT prompts (cut to 256 tokens with --truncate, as
    sentence-transformers does), five OpenAI lines and 1,200 more rows, to
    JSONL; killed once 50 rows are on disk, then resumed."""
    tmp = tmp_path_factory.mktemp("embed")
    rows: list[Any] = texts(200)
    rows[10:10] = [
        line("float", {"input": "The quick brown fox jumps over the lazy dog.", "model": "minilm"}),
        line("base64", {"input": "The quick brown fox jumps over the lazy dog.", "encoding_format": "base64"}),
        line("many", {"input": ["first text", "second text", "third"]}),
        line("many-ids", {"input": many_ids()}),  # the same three as token ids: OpenAI's fourth form
        line("chat", {"messages": [{"role": "user", "content": "hi"}]}, url="/v1/chat/completions"),
        {"id": "empty", "text": ""},
    ]
    rows += EXTRA
    src, out = tmp / "in.jsonl", tmp / "out.jsonl"
    write_jsonl(src, rows)
    flags = ["--truncate", "--max-in-flight", "8"]  # rows finish a few at a time
    run = subprocess.Popen(command(src, out, *flags), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    spool = tmp / ".out.jsonl.partial.jsonl"
    deadline = time.monotonic() + 600
    while not (spool.exists() and spool.read_bytes().count(b"\n") >= 50):
        assert run.poll() is None, run.stderr.read() if run.stderr else ""
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=60)
    kept = [record.get("custom_id") or record["id"] for _, record in spool_records(spool)]
    killed_out = out.exists()
    result = subprocess.run(
        command(src, out, "--resume", *flags), capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    return {
        "rows": rows,
        "kept": kept,
        "killed_out": killed_out,
        "result": result,
        "out": read_jsonl(out) if out.exists() else [],
        "errors": read_jsonl(tmp / "out.errors.jsonl") if (tmp / "out.errors.jsonl").exists() else [],
        "report": orjson.loads((tmp / "out.report.json").read_bytes()) if (tmp / "out.report.json").exists() else {},
    }


def test_every_row_ends_as_one_record_and_the_run_exits_3(embedded: dict[str, Any]) -> None:
    result = embedded["result"]
    assert result.returncode == 3, result.stderr[-3000:]
    ids = [r.get("custom_id") or r.get("id") for r in embedded["out"] + embedded["errors"]]
    expected = [r.get("custom_id") or r.get("id") for r in embedded["rows"]]
    assert sorted(ids) == sorted(expected)
    assert {r.get("custom_id") or r["id"] for r in embedded["errors"]} == {"chat", "empty"}
    chat = next(r for r in embedded["errors"] if r.get("custom_id") == "chat")
    assert "`bulkinfer run`" in chat["error"]["message"]
    report = embedded["report"]
    assert report["job"] == "embed" and report["request_counts"]["completed"] == 204 + len(EXTRA)
    assert report["embedding"]["normalize"] is True and report["embedding"]["max_seq_length"] == 256
    assert report["embedding"]["truncated_inputs"] > 0
    progress = [line for line in result.stderr.splitlines() if " bulkinfer: " in line and " rows (" in line]
    assert progress and all(" prompt tok/s" in line and "completion" not in line for line in progress), progress


def test_vectors_equal_sentence_transformers_encode(embedded: dict[str, Any]) -> None:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(prepare_default_encoder()), device="cpu")
    assert model.max_seq_length == 256
    rows = texts(200)
    reference = model.encode([r["text"] for r in rows], batch_size=32, convert_to_numpy=True)
    by_id = {r["id"]: r for r in embedded["out"] if "embedding" in r}
    ours = np.array([by_id[r["id"]]["embedding"] for r in rows], dtype=np.float32)
    assert ours.shape == (200, DIM)
    cosine = (ours * reference).sum(axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
    print(f"cosine vs sentence-transformers over 200 rows: min {cosine.min():.7f}, mean {cosine.mean():.7f}")
    assert cosine.min() >= 0.9999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # Normalize in modules.json
    tokens = model.tokenizer([r["text"] for r in rows], truncation=True, max_length=256)["input_ids"]
    assert [by_id[r["id"]]["prompt_tokens"] for r in rows] == [len(ids) for ids in tokens]


def test_openai_lines_validate_and_base64_decodes_to_the_same_floats(embedded: dict[str, Any]) -> None:
    lines = {r["custom_id"]: r for r in embedded["out"] if "custom_id" in r}
    assert set(lines) == {"float", "base64", "many", "many-ids"}
    for record in [*lines.values(), *(r for r in embedded["errors"] if "custom_id" in r)]:
        check_embeddings_line(record)
    floats = lines["float"]["response"]["body"]["data"][0]["embedding"]
    decoded = decode_base64(lines["base64"]["response"]["body"]["data"][0]["embedding"])
    assert len(floats) == DIM and np.allclose(decoded, floats, atol=1e-6)
    assert lines["float"]["response"]["body"]["model"] == "minilm"
    many = lines["many"]["response"]["body"]
    assert [d["index"] for d in many["data"]] == [0, 1, 2]
    # [CLS] first text [SEP], [CLS] second text [SEP], [CLS] third [SEP]
    assert many["usage"]["prompt_tokens"] == many["usage"]["total_tokens"] == 4 + 4 + 3
    ids = lines["many-ids"]["response"]["body"]  # the same inputs as token ids: the same vectors and usage
    assert ids["usage"] == many["usage"]
    for given, text in zip(ids["data"], many["data"], strict=True):
        assert np.allclose(given["embedding"], text["embedding"], atol=1e-6)


def test_kill_9_mid_run_then_resume_embeds_every_id_once(embedded: dict[str, Any]) -> None:
    kept, rows = embedded["kept"], embedded["rows"]
    assert 50 <= len(kept) < len(rows) and not embedded["killed_out"]
    ids = [r.get("custom_id") or r["id"] for r in embedded["out"] + embedded["errors"]]
    assert sorted(ids) == sorted(r.get("custom_id") or r.get("id") for r in rows)  # each exactly once
    assert [r.get("custom_id") or r["id"] for r in embedded["out"]] == [
        r.get("custom_id") or r["id"] for r in rows if (r.get("custom_id") or r["id"]) not in ("chat", "empty")
    ]  # input order
    report = embedded["report"]
    assert report["resumed"]["completed"] == len(kept)
    vectors = np.array([r["embedding"] for r in embedded["out"] if "embedding" in r], dtype=np.float32)
    assert vectors.shape == (200 + len(EXTRA), DIM)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
