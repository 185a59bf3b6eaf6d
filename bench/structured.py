"""What structured output costs: the same rows through bulkinfer as plain
completions and with a JSON schema (``response_format: json_schema``), each
run one :func:`bulkinfer.run` in this process and so its own engine, in
rounds (``--rounds``, 2) of three systems, alternating:

- ``plain``: the rows as they are;
- ``schema``: the same rows with :data:`SCHEMA` as their response format;
- ``plain-matched``: the plain rows again, each with ``ignore_eos`` and
  ``max_tokens`` = the completion tokens the ``schema`` run of this round
  gave that row: the schema run's work without the grammar (the control,
  below).

Rows (``--rows``, 200; seeded): one sentence about a made-up person ("Ana
Costa, a 41-year-old nurse, lives in Lyon.") and the request to extract the
name, age and city as a JSON object, as a one-message chat. Every system
gets the same messages; :data:`SCHEMA` is ``name`` string, ``age`` integer,
``city`` string, all required, no other keys. Greedy (temperature 0),
``max_tokens`` 64, the engine's seed 0, the default model.

What is compared: completion tokens/s of the generation phase, the
report's ``throughput.completion_tokens_per_s`` (completion tokens over
``seconds.generate``; model load and engine start are not in it). Wall time
is not a fair figure: with a schema the grammar ends a completion when the
object closes, without one the model writes what it likes (code fences, a
sentence around the object) until it stops or reaches ``max_tokens``, so
``plain`` and ``schema`` generate different numbers of tokens. What the
grammar costs (compiling the schema, masking the vocabulary each step)
shows up per token. ``ignore_eos`` cannot make ``schema``'s work equal to
``plain``'s (a finished grammar allows only the end-of-sequence token), but
it can make a plain run do ``schema``'s work: tokens/s also depends on how
many rows are running (a step's cost on this CPU is mostly fixed, so the
tail of a run, when few rows are left, makes few tokens per second), and
rows of other lengths drain the batch differently. ``plain-matched`` gives
each row exactly its ``schema`` length, so ``schema`` / ``plain-matched``
is the grammar's own cost per token, and ``schema`` / ``plain`` what a user
sees who adds a schema to these rows. ``seconds.generate`` includes the
prefill of every prompt (the same in every run), which dilutes a per-token
decode cost in both ratios; the generate seconds ``schema`` took beyond
``plain-matched`` (:func:`summary`) are the grammar's cost undiluted.

Also recorded per run: rows, completion tokens (and per row), generate
seconds, rows ended by ``max_tokens`` (``finish_reason`` "length"),
completions that parse as JSON (the whole text; and the text from the
first "{" to the last "}", which forgives fences and prose) and validate
against the schema (``jsonschema``), and those whose values are the
sentence's. The structured-output backend vLLM chose for each schema
request (``auto`` resolves it in ``SamplingParams._validate_structured_outputs``,
in this process), and the lines of the run's engine log (``OUT.log``)
naming xgrammar or guidance, if any.

Usage: ``python -m bench.structured [--rows 200 --max-tokens 64 --rounds 2]``;
writes ``bench/results/structured.{json,md}``. About 13 minutes on 2 CPU
cores; one engine at a time.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import os
import random
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
FIRST = "Ana Ben Chloe David Elena Farid Grace Hugo Ines Jonas Keiko Liam Maya Nils Olga Pablo Rosa Sami Tara Yusuf"
LAST = "Costa Berg Dubois Okafor Ivanova Haddad Novak Lindqvist Moreau Tanaka Reyes Fischer Kowalski Santos Byrne"
CITIES = "Lyon Porto Leeds Graz Turku Bergen Utrecht Ghent Bilbao Krakow Tartu Malmo Aarhus Cork Bremen Split"
JOBS = "nurse teacher baker pilot carpenter chemist librarian plumber architect translator farmer dentist".split()
SENTENCES = (
    "{name}, a {age}-year-old {job}, lives in {city}.",
    "At {age}, {name} still works as a {job} in {city}.",
    "{name} moved to {city} last spring; the {job} turned {age} in May.",
    "Born {age} years ago, {name} now runs a small {job} practice in {city}.",
    "The {job} {name} ({age}) has spent the last decade in {city}.",
    "In {city}, everyone knows {name}, the {age}-year-old {job}.",
)
PROMPT = (
    'Extract the person\'s name, age and city from the text below. Answer with a JSON object with the keys "name" '
    '(string), "age" (integer) and "city" (string), and nothing else.\n\nText: {sentence}'
)
SYSTEMS = ("plain", "schema", "plain-matched")
BACKEND_WORDS = re.compile(r"xgrammar|guidance|outlines|lm-format-enforcer", re.IGNORECASE)


def people(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` made-up people (``id``, ``sentence``, and the ``name``, ``age``,
    ``city`` it states); deterministic for a seed."""
    rng = random.Random(seed)
    first, last, cities = FIRST.split(), LAST.split(), CITIES.split()
    rows = []
    for i in range(n):
        name, age, city = f"{rng.choice(first)} {rng.choice(last)}", rng.randint(18, 90), rng.choice(cities)
        sentence = rng.choice(SENTENCES).format(name=name, age=age, city=city, job=rng.choice(JOBS))
        rows.append({"id": f"person-{i}", "sentence": sentence, "name": name, "age": age, "city": city})
    return rows


def input_rows(persons: list[dict[str, Any]], system: str, lengths: dict[str, int]) -> list[dict[str, Any]]:
    """bulkinfer rows for ``persons``: one user message each; for ``schema``
    the response format, for ``plain-matched`` ``ignore_eos`` and ``max_tokens``
    from ``lengths`` (completion tokens by id)."""
    rows = []
    for person in persons:
        row: dict[str, Any] = {
            "id": person["id"],
            "messages": [{"role": "user", "content": PROMPT.format(sentence=person["sentence"])}],
        }
        if system == "schema":
            row["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        elif system == "plain-matched":
            row.update(max_tokens=lengths[person["id"]], ignore_eos=True)
        rows.append(row)
    return rows


def _json(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


def completion_lengths(out: Path) -> dict[str, int]:
    """Completion tokens by row id in an output file."""
    rows = (orjson.loads(line) for line in out.read_bytes().splitlines())
    return {row["id"]: row["completion_tokens"] for row in rows}


def check_outputs(out: Path, persons: list[dict[str, Any]]) -> dict[str, int]:
    """Counts over the output rows of one run: ``length`` (``finish_reason``
    "length"), ``parsed`` / ``valid`` / ``correct`` (the whole completion is
    JSON / valid against :data:`SCHEMA` / valid and equal to the sentence's
    name, age and city), and the same from the first "{" to the last "}"
    (``extracted_*``)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(SCHEMA)
    truth = {p["id"]: {"name": p["name"], "age": p["age"], "city": p["city"]} for p in persons}
    counts: collections.Counter[str] = collections.Counter()
    for line in out.read_bytes().splitlines():
        row = orjson.loads(line)
        text = row["completion"]
        counts["rows"] += 1
        counts["length"] += row["finish_reason"] == "length"
        start, end = text.find("{"), text.rfind("}")
        for prefix, value in (("", _json(text)), ("extracted_", _json(text[start : end + 1]) if start >= 0 else None)):
            valid = value is not None and validator.is_valid(value)
            counts[prefix + "parsed"] += value is not None
            counts[prefix + "valid"] += valid
            counts[prefix + "correct"] += valid and value == truth[row["id"]]
    keys = ("rows", "length", "parsed", "valid", "correct", "extracted_parsed", "extracted_valid", "extracted_correct")
    return {key: counts[key] for key in keys}


def backend_lines(log: Path) -> list[str]:
    """The distinct lines of an engine log that name a structured-output backend."""
    if not log.exists():
        return []
    lines = log.read_text(errors="replace").splitlines()
    return list(dict.fromkeys(line.strip() for line in lines if BACKEND_WORDS.search(line)))


def one_run(
    system: str, persons: list[dict[str, Any]], lengths: dict[str, int], work: Path, index: int, settings: Any
) -> dict[str, Any]:
    """One :func:`bulkinfer.run` of ``persons`` as ``system`` (see
    :func:`input_rows`); its figures, and ``lengths``: completion tokens by id."""
    from bulkinfer import run

    src = work / f"{system}-{index}.jsonl"
    src.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in input_rows(persons, system, lengths)))
    out = work / f"{system}-{index}.out.jsonl"
    report = run(src, out, settings=settings, overwrite=True, progress_plain=True).report
    assert report["request_counts"]["failed"] == 0, report["request_counts"]
    completion_tokens = report["tokens"]["completion"]
    return {
        "system": system,
        "round": index,
        "model": report["model"],
        "rows": report["request_counts"]["completed"],
        "prompt_tokens": report["tokens"]["prompt"],
        "completion_tokens": completion_tokens,
        "completion_tokens_per_row": completion_tokens / report["request_counts"]["completed"],
        "seconds_load": report["seconds"]["load"],
        "seconds_generate": report["seconds"]["generate"],
        "completion_tokens_per_s": report["throughput"]["completion_tokens_per_s"],
        "outputs": check_outputs(out, persons),
        "log_backend_lines": backend_lines(out.with_name(out.stem + ".log")),
        "engine": report["engine"],
        "lengths": completion_lengths(out),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures over the runs: mean completion tokens/s per system; the
    ratios of ``schema`` to ``plain`` and to ``plain-matched`` (per round, and
    of the means); and ``grammar_seconds``, per round the generate seconds
    ``schema`` took beyond ``plain-matched`` (the same tokens), also per
    completion token in milliseconds."""
    tps = {s: [r["completion_tokens_per_s"] for r in runs if r["system"] == s] for s in SYSTEMS}
    ratios = {}
    for base in ("plain", "plain-matched"):
        per_round = [s / b for b, s in zip(tps[base], tps["schema"], strict=True)]
        ratios[base] = {"per_round": per_round, "mean": statistics.mean(tps["schema"]) / statistics.mean(tps[base])}
    by_system = {s: [r for r in runs if r["system"] == s] for s in ("schema", "plain-matched")}
    grammar = [
        {
            "seconds": schema["seconds_generate"] - matched["seconds_generate"],
            "ms_per_completion_token": 1000
            * (schema["seconds_generate"] - matched["seconds_generate"])
            / schema["completion_tokens"],
        }
        for schema, matched in zip(by_system["schema"], by_system["plain-matched"], strict=True)
    ]
    return {
        "mean_completion_tokens_per_s": {s: statistics.mean(v) for s, v in tps.items()},
        "ratios": ratios,
        "ratio": ratios["plain"]["mean"],
        "ratio_same_lengths": ratios["plain-matched"]["mean"],
        "grammar_seconds": grammar,
    }


def write_markdown(doc: dict[str, Any], path: Path) -> str:
    """The results page: one line per run, the ratios, the machine and the command."""
    machine = doc["machine"]
    on = f"{machine['cpu']}, {machine['cores']} cores"
    lines = [
        f"# Structured output (JSON schema) vs plain completions ({doc['date']}; {on})",
        "",
        f"Command: `{doc['command']}`; {doc['rows']} extraction rows, greedy, max_tokens {doc['max_tokens']}, "
        f"model {doc['model']} (float32, CPU), vLLM {doc['vllm_version']}; runs in this order, each its own engine.",
        "",
        "| round | system | completion tok/s | completion tokens | tokens/row | generate s | length-capped "
        "| JSON parses | schema-valid | values right | valid from first { to last } |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["runs"]:
        o, n = r["outputs"], r["outputs"]["rows"]
        quality = (
            f"| {o['parsed']}/{n} | {o['valid']}/{n} | {o['correct']}/{n} | {o['extracted_valid']}/{n} |"
            if r["system"] != "plain-matched"
            else "| - | - | - | - |"
        )
        lines.append(
            f"| {r['round']} | {r['system']} | {r['completion_tokens_per_s']:.1f} | {r['completion_tokens']:,} "
            f"| {r['completion_tokens_per_row']:.1f} | {r['seconds_generate']:.1f} | {o['length']} " + quality
        )
    lines += [""]
    for key, label in (("plain", "schema / plain"), ("plain-matched", "schema / plain-matched")):
        ratio = doc["ratios"][key]
        per_round = ", ".join(f"{x:.3f}" for x in ratio["per_round"])
        lines.append(
            f"- Completion tokens/s, {label}: **{ratio['mean']:.3f}** "
            f"(mean over rounds; per round {per_round}) on {on}."
        )
    extra = ", ".join(
        f"{g['seconds']:.1f} s ({g['ms_per_completion_token']:.2f} ms/token)" for g in doc["grammar_seconds"]
    )
    lines += [
        f"- Generate seconds of schema beyond plain-matched (the same {doc['runs'][1]['completion_tokens']:,} "
        f"completion tokens), per round: {extra}.",
        "",
        f"Structured-output backend (vLLM's choice under `auto`, per schema request): {doc['backend']}.",
        "",
        "Tokens/s of the generation phase only (the report's `throughput.completion_tokens_per_s`; engine load "
        "excluded). `plain` and `schema` generate different token counts (the grammar ends a completion when the "
        "object closes), so wall times are not compared. `plain-matched` is the plain rows with `ignore_eos` and "
        "each row's `max_tokens` set to its `schema` length in the same round: the same work without the grammar, "
        "so schema / plain-matched is the grammar's own cost per token (its quality columns would measure nothing). "
        "Generate seconds include the prefill of every prompt "
        f"({doc['runs'][0]['prompt_tokens']:,} prompt tokens, the same in every run), so a per-token decode cost "
        "is diluted in the ratios; the seconds beyond plain-matched are not. See `bench/structured.py`'s docstring.",
    ]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the rows' seed")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep inputs, outputs and engine logs here")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "structured.json")
    args = parser.parse_args()

    from vllm.sampling_params import SamplingParams

    from bulkinfer import load_settings
    from bulkinfer.engine.args import cpu_model

    backends: collections.Counter[str] = collections.Counter()
    validate = SamplingParams._validate_structured_outputs

    def recording_validate(self: Any, *a: Any, **kw: Any) -> None:
        validate(self, *a, **kw)
        if self.structured_outputs is not None:
            backends[str(self.structured_outputs._backend)] += 1

    SamplingParams._validate_structured_outputs = recording_validate  # type: ignore[method-assign]
    settings = load_settings(None, {"sampling.max_tokens": args.max_tokens, "sampling.temperature": 0.0})
    persons = people(args.rows, args.seed)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for index in range(1, args.rounds + 1):
            lengths: dict[str, int] = {}
            for system in SYSTEMS:
                before = sum(backends.values())
                result = one_run(system, persons, lengths, work, index, settings)
                result["schema_requests"] = sum(backends.values()) - before
                if system == "schema":
                    lengths = result["lengths"]
                runs.append(result)
                print(
                    f"bench.structured: round {index} {system}: {result['completion_tokens_per_s']:.1f} "
                    f"completion tok/s, {result['completion_tokens']} tokens, {result['outputs']}",
                    flush=True,
                )
    engine = runs[0]["engine"]
    doc: dict[str, Any] = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "date": dt.date.today().isoformat(),
        "command": f"python -m bench.structured --rows {args.rows} --max-tokens {args.max_tokens} "
        f"--rounds {args.rounds}",
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "model": runs[0]["model"],
        "vllm_version": engine.get("vllm_version"),
        "schema": SCHEMA,
        "prompt": PROMPT,
        "backend": ", ".join(f"{name} ({n} requests)" for name, n in backends.items()) or "none recorded",
        "backend_counts": dict(backends),
        "runs": [{k: v for k, v in r.items() if k not in ("engine", "lengths")} for r in runs],
        "engine": engine,
        **summary(runs),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    print(write_markdown(doc, args.out.with_suffix(".md")))


if __name__ == "__main__":
    main()
