"""Every request field of the table (:data:`bulkinfer.fields.FIELDS`) through
every input path the table says accepts it, into vLLM's real
``SamplingParams`` / ``StructuredOutputsParams`` (or the request's
priority): bulkinfer rows in JSONL and Parquet (``passthrough`` on and
off), OpenAI ``/v1/chat/completions`` and ``/v1/completions`` batch
bodies, ``[sampling]`` in a TOML file, and ``bulkinfer run``'s flags. A
path the table says does not accept a field refuses it (an error record, a
ConfigError, no such option): never dropped. Each value differs from the
default, so each assertion could fail (issue 33).

The runs use the fake engine, which records each request and builds its
``SamplingParams`` with :func:`bulkinfer.engine.sampling.sampling_params`,
as the vLLM engine does; no engine starts."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fakes import FakeEngine
from typer.testing import CliRunner
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

import bulkinfer.jobs.run
from bulkinfer.cli import app
from bulkinfer.cli.options import OVERRIDES
from bulkinfer.cli.run_command import run as run_command
from bulkinfer.config import SamplingDefaults, Settings, load_settings, option_keys
from bulkinfer.engine.sampling import sampling_params
from bulkinfer.errors import ConfigError
from bulkinfer.fields import CHAT, COMPLETIONS, CONFIG, FIELDS, FLAG, ROW, InputPath, fields_of
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.engine_choice import with_priority_scheduling
from bulkinfer.prep.chat_template import TEMPLATE_FIELDS
from bulkinfer.prep.rows import BODY_FIELDS, CONSUMED_FIELDS, SAMPLING_FIELDS, parse_row
from bulkinfer.schema import CHAT_URL, COMPLETIONS_URL, Request

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@dataclasses.dataclass(frozen=True)
class Sample:
    """A field's value in an input, and where vLLM holds it: ``at`` a
    ``SamplingParams`` attribute (``structured_outputs.json``: of its
    ``StructuredOutputsParams``) or ``priority`` (the request's)."""

    value: Any
    at: str
    holds: Any
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the field needs besides


# One value of every field, none the default.
SAMPLES: dict[str, Sample] = {
    "max_tokens": Sample(7, "max_tokens", 7),
    "max_completion_tokens": Sample(7, "max_tokens", 7),
    "temperature": Sample(0.25, "temperature", 0.25),
    "top_p": Sample(0.5, "top_p", 0.5),
    "seed": Sample(1234, "seed", 1234),
    "stop": Sample(["END"], "stop", ["END"]),
    "ignore_eos": Sample(True, "ignore_eos", True),
    "n": Sample(3, "n", 3),
    "presence_penalty": Sample(0.5, "presence_penalty", 0.5),
    "frequency_penalty": Sample(-0.5, "frequency_penalty", -0.5),
    "repetition_penalty": Sample(1.2, "repetition_penalty", 1.2),
    "top_k": Sample(5, "top_k", 5),
    "min_p": Sample(0.05, "min_p", 0.05),
    "min_tokens": Sample(2, "min_tokens", 2),
    "stop_token_ids": Sample([2, 7], "stop_token_ids", [2, 7]),
    "logit_bias": Sample({"42": -5.0}, "logit_bias", {42: -5.0}),
    "logprobs": Sample(3, "logprobs", 3),
    "top_logprobs": Sample(2, "logprobs", 2, {"logprobs": True}),
    "priority": Sample(-3, "priority", -3),
    "response_format": Sample(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}, "structured_outputs.json", SCHEMA
    ),
    "structured_outputs": Sample({"choice": ["yes", "no"]}, "structured_outputs.choice", ["yes", "no"]),
}
# A chat body's logprobs is true or false (OpenAI's chat API): true alone is the chosen token's only.
CHAT_SAMPLES = {**SAMPLES, "logprobs": Sample(True, "logprobs", 0)}
# A flag's arguments and what vLLM then holds, where they differ from the field's sample.
FLAG_ARGS: dict[str, tuple[list[str], Any]] = {
    "stop": (["--stop", "END", "--stop", "STOP"], ["END", "STOP"]),
    "stop_token_ids": (["--stop-token-ids", "2", "--stop-token-ids", "7"], [2, 7]),
    "logit_bias": (["--logit-bias", "42=-5"], {42: -5.0}),
    "ignore_eos": (["--ignore-eos"], True),
    "priority": (["--priority=-3"], -3),
    "choice": (["--choice", "yes,no"], ["yes", "no"]),
}


def cases(path: InputPath) -> list[str]:
    return [name for name, field in FIELDS.items() if field.accepts(path)]


def refusals(path: InputPath) -> list[str]:
    return [name for name, field in FIELDS.items() if not field.accepts(path)]


@dataclasses.dataclass(frozen=True)
class Sent:
    """A request as the engine got it: the request, the vLLM ``SamplingParams``
    built for it, and the settings the engine was built with."""

    request: Request
    params: Any
    settings: Settings


class Recording(FakeEngine):
    """A fake engine that keeps what each request would send to vLLM, by row id."""

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.built_with = settings
        self.sent: dict[str, Sent] = {}

    def add(self, request_id: str, request: Request) -> Any:
        params = sampling_params(request, SamplingParams, RequestOutputKind.DELTA)
        self.sent[request.id] = Sent(request, params, self.built_with)
        return super().add(request_id, request)


def held(sent: Sent, at: str) -> Any:
    """What vLLM holds at ``at`` (see :class:`Sample`); None where it holds nothing."""
    if at == "priority":
        return sent.request.priority
    value = sent.params
    for part in at.split("."):
        value = getattr(value, part, None)
    return value


def _plain() -> Sent:
    """What a row without any field sends, all defaults."""
    request = parse_row({"prompt": "hi"}, 0, 1, SamplingDefaults())
    return Sent(request, sampling_params(request, SamplingParams, RequestOutputKind.DELTA), Settings())


def assert_reaches(sent: Sent, at: str, holds: Any) -> None:
    """vLLM holds ``holds`` at ``at`` for ``sent``, and by default it would not."""
    assert held(_plain(), at) != holds  # the assertion could fail
    assert held(sent, at) == holds
    if at == "priority":  # vLLM refuses a priority under its default scheduling policy
        assert sent.settings.engine.extra_args["scheduling_policy"] == "priority"


def run_file(src: Path, settings: Settings) -> tuple[dict[str, Sent], list[dict[str, Any]], list[dict[str, Any]]]:
    """Run ``src`` on a recording fake engine: what each row sent, the output
    records and the error records."""
    engines: list[Recording] = []

    def factory(model: str, built: Settings) -> Recording:
        engines.append(Recording(built))
        return engines[-1]

    out = src.with_name(src.stem + ".out.jsonl")
    bulkinfer.jobs.run.run(RunPaths.build(src, out), settings, RunContext(engine_factory=factory))
    errors = out.with_name(out.stem + ".errors.jsonl")
    read = [
        [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []
        for path in (out, errors)
    ]
    return engines[0].sent, read[0], read[1]


def _row(name: str) -> dict[str, Any]:
    sample = SAMPLES[name]
    return {"id": name, "prompt": "hello there", **sample.extra, name: sample.value, "reference": "kept"}


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    """``rows`` as one Parquet table, each column null where a row lacks it."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return pa.Table.from_pylist([{key: row.get(key) for key in keys} for row in rows])


def _parquet_groups(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``rows`` in groups that one Parquet table each holds exactly (a column has one type)."""
    groups: list[list[dict[str, Any]]] = []
    for row in rows:
        for group in groups:
            try:
                table = _table([*group, row])
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                continue
            if [{k: v for k, v in r.items() if v is not None} for r in table.to_pylist()] == [*group, row]:
                group.append(row)
                break
        else:
            groups.append([row])
    return groups


@pytest.fixture(scope="module")
def row_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], dict[str, tuple[Sent, Any]]]:
    """Every field a row accepts, one row each, run from JSONL and Parquet with
    ``passthrough`` on and off: (suffix, passthrough) -> row id -> what it
    sent and its output record."""
    rows = [_row(name) for name in cases(ROW)]
    runs: dict[tuple[str, bool], dict[str, tuple[Sent, Any]]] = {}
    for passthrough in (True, False):
        settings = load_settings(None, {"passthrough": passthrough})
        tmp = tmp_path_factory.mktemp(f"rows-{passthrough}")
        (tmp / "in.jsonl").write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
        sent, outputs, errors = run_file(tmp / "in.jsonl", settings)
        assert errors == []
        runs[".jsonl", passthrough] = {output["id"]: (sent[output["id"]], output) for output in outputs}
        runs[".parquet", passthrough] = {}
        for i, group in enumerate(_parquet_groups(rows)):
            pq.write_table(_table(group), tmp / f"in{i}.parquet")
            sent, outputs, errors = run_file(tmp / f"in{i}.parquet", settings)
            assert errors == []
            runs[".parquet", passthrough].update({output["id"]: (sent[output["id"]], output) for output in outputs})
    return runs


@pytest.mark.parametrize("passthrough", [True, False])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("name", cases(ROW))
def test_a_rows_field_reaches_vllm(row_runs: dict[Any, Any], name: str, suffix: str, passthrough: bool) -> None:
    sent, output = row_runs[suffix, passthrough][name]
    assert_reaches(sent, SAMPLES[name].at, SAMPLES[name].holds)
    assert name not in sent.request.passthrough
    # with passthrough = false the other fields are neither copied nor (from Parquet) read
    assert ("reference" in sent.request.passthrough) == ("reference" in output) == passthrough


def test_a_row_accepts_every_field() -> None:
    # a row's other fields pass through to the output (by design): so none of the table's may be left out
    assert set(FIELDS) == set(cases(ROW)) == SAMPLING_FIELDS
    assert SAMPLING_FIELDS <= CONSUMED_FIELDS  # what a Parquet reader reads with passthrough = false


def _openai(url: str, name: str, samples: dict[str, Sample]) -> dict[str, Any]:
    sample = samples[name]
    text = {"messages": [{"role": "user", "content": "hello"}]} if url == CHAT_URL else {"prompt": "hello"}
    body = {**text, **sample.extra, name: sample.value, "model": "m"}
    return {"custom_id": name, "method": "POST", "url": url, "body": body}


@pytest.fixture(scope="module")
def body_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One OpenAI batch file per endpoint with one line per table field: path -> :func:`run_file`'s."""
    runs = {}
    for path, url, samples in ((CHAT, CHAT_URL, CHAT_SAMPLES), (COMPLETIONS, COMPLETIONS_URL, SAMPLES)):
        src = tmp_path_factory.mktemp(path) / "batch.jsonl"
        src.write_bytes(b"".join(orjson.dumps(_openai(url, name, samples)) + b"\n" for name in FIELDS))
        runs[path] = run_file(src, load_settings())
    return runs


@pytest.mark.parametrize(("path", "name"), [(path, name) for path in (CHAT, COMPLETIONS) for name in cases(path)])
def test_an_openai_body_field_reaches_vllm(body_runs: dict[str, Any], path: InputPath, name: str) -> None:
    sent, _, _ = body_runs[path]
    sample = (CHAT_SAMPLES if path == CHAT else SAMPLES)[name]
    assert_reaches(sent[name], sample.at, sample.holds)


@pytest.mark.parametrize(("path", "name"), [(path, name) for path in (CHAT, COMPLETIONS) for name in refusals(path)])
def test_an_openai_body_refuses_a_field_it_does_not_take(body_runs: dict[str, Any], path: InputPath, name: str) -> None:
    sent, _, errors = body_runs[path]
    assert name not in sent
    (error,) = [e for e in errors if e["custom_id"] == name]
    assert error["error"]["code"] == "unsupported_field"
    assert f"'body.{name}' is not supported" in error["error"]["message"]


def test_the_body_fields_are_the_tables() -> None:
    assert BODY_FIELDS[CHAT_URL] == {"messages", *TEMPLATE_FIELDS} | fields_of(CHAT)  # and the chat template's
    assert BODY_FIELDS[COMPLETIONS_URL] == {"prompt"} | fields_of(COMPLETIONS)
    assert refusals(COMPLETIONS) == ["max_completion_tokens", "top_logprobs"]  # OpenAI's completions have neither


def _one_row(tmp_path: Path) -> Path:
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "r", "prompt": "hello there"}\n')
    return src


def _toml(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml, value)) + "]"
    return json.dumps(value)  # true, numbers and strings are spelt alike


def test_every_sampling_key_is_a_field_of_the_table() -> None:
    assert [f.name for f in dataclasses.fields(SamplingDefaults)] == cases(CONFIG)


@pytest.mark.parametrize("name", cases(CONFIG))
def test_a_sampling_default_reaches_vllm(tmp_path: Path, name: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f"[sampling]\n{name} = {_toml(SAMPLES[name].value)}\n")
    settings = with_priority_scheduling(load_settings(config), rows_set_priority=False)  # as a run does
    request = parse_row({"prompt": "hi"}, 0, 1, settings.sampling)
    sent = Sent(request, sampling_params(request, SamplingParams, RequestOutputKind.DELTA), settings)
    assert_reaches(sent, SAMPLES[name].at, SAMPLES[name].holds)


@pytest.mark.parametrize("name", refusals(CONFIG))
def test_a_sampling_key_the_table_does_not_take_is_refused(tmp_path: Path, name: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f"[sampling]\n{name} = {_toml(SAMPLES[name].value)}\n")
    with pytest.raises(ConfigError, match=f"unknown setting.*{name}"):
        load_settings(config)


# --- bulkinfer run's flags -----------------------------------------------------------------------

runner = CliRunner()
FLAG_CASES = [(name, flag) for name in cases(FLAG) for flag in FIELDS[name].flags]


def _flag_args(name: str, flag: str, tmp: Path) -> tuple[list[str], str, Any]:
    """The arguments that set ``name`` by ``--flag``, where vLLM holds it and what."""
    sample = SAMPLES[name]
    if flag == "json_schema":
        (tmp / "schema.json").write_text(json.dumps(SCHEMA))
        return ["--json-schema", str(tmp / "schema.json")], "structured_outputs.json", SCHEMA
    if flag == "regex":
        return ["--regex", "[a-z]+"], "structured_outputs.regex", "[a-z]+"
    if flag in FLAG_ARGS:
        args, holds = FLAG_ARGS[flag]
        return args, sample.at, holds
    return ["--" + flag.replace("_", "-"), str(sample.value)], sample.at, sample.holds


def _cli_run(tmp: Path, args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Recording]]:
    """``bulkinfer run`` on one row (id ``r``) with ``args``: its result, and its recording engines."""
    built: list[Recording] = []

    def factory(model: str, settings: Settings) -> Recording:
        built.append(Recording(settings))
        return built[-1]

    monkeypatch.setattr("bulkinfer.jobs.context.vllm_engine", factory)  # every RunContext's default
    return runner.invoke(app, ["run", str(_one_row(tmp)), "-o", str(tmp / "out.jsonl"), *args]), built


@pytest.fixture(scope="module")
def flag_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Sent, str, Any]]:
    """Every flag of the table, in as few runs as fields allow (a field's
    second flag in a second run): (field, flag) -> (what was sent, where, what)."""
    runs = {}
    for turn in range(max(len(FIELDS[name].flags) for name in cases(FLAG))):
        tmp = tmp_path_factory.mktemp(f"flags{turn}")
        given = {
            (name, flag): _flag_args(name, flag, tmp)
            for name, flag in FLAG_CASES
            if FIELDS[name].flags[turn : turn + 1] == (flag,)
        }
        with pytest.MonkeyPatch.context() as patch:
            result, [engine] = _cli_run(tmp, [arg for args, _, _ in given.values() for arg in args], patch)
        assert result.exit_code == 0, result.output
        runs.update({case: (engine.sent["r"], at, holds) for case, (_, at, holds) in given.items()})
    return runs


@pytest.mark.parametrize(("name", "flag"), FLAG_CASES)
def test_a_flag_reaches_vllm(flag_runs: dict[Any, Any], name: str, flag: str) -> None:
    assert flag in inspect.signature(run_command).parameters  # an option of bulkinfer run
    if flag == name:
        assert flag in OVERRIDES and option_keys()[flag] == f"sampling.{name}"
    assert_reaches(*flag_runs[name, flag])


@pytest.mark.parametrize("name", refusals(FLAG))
def test_a_field_without_a_flag_has_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    assert name not in OVERRIDES or option_keys()[name] != f"sampling.{name}"
    result, built = _cli_run(tmp_path, ["--" + name.replace("_", "-"), str(SAMPLES[name].value)], monkeypatch)
    if name == "seed":  # --seed is vLLM's engine seed; a request's seed comes from its row or [sampling]
        assert result.exit_code == 0, result.output
        [engine] = built
        assert (engine.sent["r"].request.seed, engine.built_with.engine.seed) == (None, SAMPLES["seed"].value)
        return
    assert result.exit_code == 2  # no such option: refused, not ignored
    assert "No such option" in result.output
    assert built == []
