"""A row that names a token outside the model's vocabulary (``stop_token_ids``,
``logit_bias``, a prompt of token ids) is refused before the engine, exactly
where vLLM's own checks would refuse it when the row is added: checked
against vLLM 0.32's ``SamplingParams`` validators and its renderer's
``validate_token_ids``, fed vLLM's own vocabulary size of the model's config
and its cached tokenizer's ``max_token_id``. The model is the tiny stand-in
(tests/tiny_model.py: 23 token ids) with a ``vocab_size`` in its config on
either side of its tokenizer's; tests/e2e/test_e2e.py runs the default model."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
import tiny_model
from fakes import FakeEngine, assert_defaults_refused
from reference_types import check_openai_line
from transformers import AutoConfig
from vllm.exceptions import VLLMValidationError
from vllm.renderers.base import BaseRenderer
from vllm.sampling_params import SamplingParams
from vllm.tokenizers.hf import get_cached_tokenizer
from vllm.transformers_utils.config import get_hf_text_config
from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

from bulkinfer.config import SamplingDefaults, load_settings
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.models import load_tokenizer
from bulkinfer.prep.rows import parse_row
from bulkinfer.prep.vocabulary import Vocabulary, model_vocab_size, vocabulary
from bulkinfer.schema import COMPLETIONS_URL, Request

TOKENIZER_IDS = len(tiny_model.SPECIAL) + len(tiny_model.WORDS)  # 23: ids 0-22


def model_with_vocab(directory: Path, vocab_size: int) -> str:
    """The tiny model, its config saying ``vocab_size``."""
    model_dir = tiny_model.build(directory)
    config = orjson.loads((model_dir / "config.json").read_bytes())
    (model_dir / "config.json").write_bytes(orjson.dumps({**config, "vocab_size": vocab_size}))
    return str(model_dir)


def parse(data: Any, defaults: SamplingDefaults | None = None) -> Request:
    return parse_row(data, seq=0, line=1, defaults=defaults or SamplingDefaults())


def vllm_refuses(check: Any, *args: Any) -> bool:
    try:
        check(*(a for a in args if a is not None))
    except VLLMValidationError:
        return True
    return False


# a model with more ids than its tokenizer (Qwen's case), and one with fewer (multimodal placeholders)
@pytest.mark.parametrize("vocab_size", [32, 20])
def test_refused_exactly_where_vllm_refuses(tmp_path: Path, vocab_size: int) -> None:
    path = model_with_vocab(tmp_path, vocab_size)
    tokenizer = load_tokenizer(path)
    hf_config = AutoConfig.from_pretrained(path)
    vllm_size = ModelArchConfigConvertorBase(hf_config, get_hf_text_config(hf_config)).get_vocab_size()
    vocab = vocabulary(tokenizer, path)
    assert vocab is not None and vocab.size == vllm_size == vocab_size
    assert vocab.max_prompt_id == max(vocab_size, TOKENIZER_IDS) - 1
    model_config = SimpleNamespace(get_vocab_size=lambda: vllm_size)
    renderer = SimpleNamespace(tokenizer=get_cached_tokenizer(tokenizer), model_config=model_config)
    refused: dict[str, list[int]] = {"stop_token_ids": [], "logit_bias": [], "prompt": []}
    for token_id in range(40):
        cases = {
            "stop_token_ids": (
                {"id": "r", "prompt": "hi", "stop_token_ids": [token_id]},
                SamplingParams(stop_token_ids=[token_id])._validate_stop_token_ids,
            ),
            "logit_bias": (
                {"id": "r", "prompt": "hi", "logit_bias": {str(token_id): 1}},
                SamplingParams(logit_bias={token_id: 1.0})._validate_logit_bias,
            ),
            "prompt": (
                {"id": "r", "prompt": [5, token_id]},
                functools.partial(BaseRenderer.validate_token_ids, renderer, [5, token_id]),
            ),
        }
        for field, (row, check) in cases.items():
            problem = vocab.problem(parse(row))
            assert (problem is not None) == vllm_refuses(check, model_config if field != "prompt" else None), field
            if problem is not None:
                refused[field].append(token_id)
                highest = vocab.max_prompt_id if field == "prompt" else vocab_size - 1
                said = f"field '{field}': token id {token_id} is outside the model's vocabulary: ids 0-{highest}"
                assert problem == said
    assert refused["stop_token_ids"] == refused["logit_bias"] == list(range(vocab_size, 40))
    assert refused["prompt"] == list(range(max(vocab_size, TOKENIZER_IDS), 40))


def test_a_default_is_named_as_one_and_a_prompt_of_several_by_its_index() -> None:
    vocab = Vocabulary(size=100, max_prompt_id=99)
    defaults = SamplingDefaults(stop_token_ids=(7, 100), logit_bias={"99": 2.0})
    assert vocab.problem(parse({"id": "r", "prompt": "hi"}, defaults)) == (
        "field 'stop_token_ids (the [sampling] default)': token id 100 is outside the model's vocabulary: ids 0-99"
    )
    assert vocab.problem(parse({"id": "r", "prompt": "hi", "stop_token_ids": [3]}, defaults)) is None
    line = {"custom_id": "c", "url": COMPLETIONS_URL, "body": {"prompt": [[1, 2], "text", [3, 120]], "max_tokens": 4}}
    assert vocab.problem(parse(line)) == "field 'prompt[2]': token id 120 is outside the model's vocabulary: ids 0-99"
    assert vocab.problem(parse({"id": "r", "prompt": [99], "logit_bias": {"0": -1}})) is None


@pytest.mark.parametrize(
    ("config", "size"),
    [
        ({"vocab_size": 32000}, 32000),
        ({"vocab_size": 32000, "text_config": {"vocab_size": 151936}}, 151936),  # the language model's
        ({"language_config": {"vocab_size": 1000}}, 1000),
        ({"text_config": {"hidden_size": 8}, "vocab_size": 500}, 500),
        ({"hidden_size": 8}, None),
        ({"vocab_size": True}, None),
        ({"vocab_size": 0}, None),
    ],
)
def test_model_vocab_size_reads_the_language_models_config(tmp_path: Path, config: dict[str, Any], size: Any) -> None:
    (tmp_path / "config.json").write_bytes(orjson.dumps(config))
    assert model_vocab_size(str(tmp_path)) == size


def test_no_config_leaves_the_rows_to_the_engine(tmp_path: Path) -> None:
    assert model_vocab_size("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a hub id: not looked into
    assert model_vocab_size(str(tmp_path)) is None
    (tmp_path / "config.json").write_text("{not json")
    assert vocabulary(object(), str(tmp_path)) is None


def test_a_run_refuses_them_before_the_engine_and_runs_the_rest(tmp_path: Path) -> None:
    engine = FakeEngine()
    rows = [
        {"id": "ok", "prompt": "hi", "stop_token_ids": [2], "logit_bias": {"19": 1}},
        {"id": "stop", "prompt": "hi", "stop_token_ids": [20]},
        {"id": "ids", "prompt": [1, 2, 23]},
        {"custom_id": "line", "url": COMPLETIONS_URL, "body": {"model": "m", "prompt": [[1], [30]], "max_tokens": 2}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    paths = RunPaths.build(src, tmp_path / "out.jsonl")
    settings = dataclasses.replace(load_settings(), model=model_with_vocab(tmp_path / "home", 20))
    run(paths, settings, RunContext(engine_factory=lambda model, settings: engine))
    errors = [orjson.loads(line) for line in paths.errors.read_bytes().splitlines()]
    assert list(engine.reached) == ["ok"]
    assert [(e["id"], e["error"]["type"]) for e in errors if "custom_id" not in e] == [
        ("stop", "invalid_field"),
        ("ids", "invalid_field"),
    ]
    line = next(e for e in errors if e.get("custom_id") == "line")  # an OpenAI line's error is an OpenAI record
    check_openai_line(line)  # vLLM's BatchRequestOutput
    assert line["response"] is None and line["error"] == {
        "code": "invalid_field",
        "message": "field 'prompt[1]': token id 30 is outside the model's vocabulary: ids 0-22",
    }


def test_plan_counts_them_as_the_run_would_fail_them(tmp_path: Path) -> None:
    from bulkinfer.jobs.plan import plan_file

    src = tmp_path / "in.jsonl"
    rows = [{"id": "ok", "prompt": [1, 2]}, {"id": "bias", "prompt": "hi", "logit_bias": {"25": 5}}]
    src.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    settings = dataclasses.replace(load_settings(), model=model_with_vocab(tmp_path / "home", 20))
    plan = plan_file(src, settings)
    assert plan["rows"] == {"total": 2, "valid": 1, "failed": 1, "skipped": 0}
    assert plan["errors"] == {"invalid_field": 1}


def test_an_online_request_naming_one_is_refused_as_a_batch_row_is(tmp_path: Path) -> None:
    from bulkinfer.engine.mux import EngineMux
    from bulkinfer.jobs.online import OnlineRequests
    from bulkinfer.schema import CHAT_URL, RowInvalid

    path = model_with_vocab(tmp_path, 20)
    tokenizer = load_tokenizer(path)
    settings = load_settings().resolve_chat_template(tokenizer)
    mux = EngineMux(FakeEngine())
    try:
        online = OnlineRequests(mux, tokenizer, settings, "m", vocabulary(tokenizer, path))
        body = {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [21]}
        with pytest.raises(RowInvalid) as info:
            online.prepare(CHAT_URL, body)
        assert info.value.type == "invalid_field" and "token id 21 is outside" in info.value.message
        assert online.prepare(CHAT_URL, {**body, "stop_token_ids": [19]}).options["stop_token_ids"] == [19]
    finally:
        mux.close()


def test_defaults_outside_it_refuse_run_stream_and_plan_before_a_row_or_an_engine(tmp_path: Path) -> None:
    vocab = Vocabulary(size=20, max_prompt_id=22)
    assert vocab.defaults_problem(SamplingDefaults(stop_token_ids=(3, 19), logit_bias={"0": 1.0})) is None
    assert vocab.defaults_problem(SamplingDefaults(logit_bias={"4": 1.0, "20": -1.0})) == (
        "sampling.logit_bias (--logit-bias or the config): token id 20 is outside the model's vocabulary: ids 0-19"
    )
    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps({"id": "r", "prompt": "hi"}) + b"\n")
    settings = dataclasses.replace(load_settings(), model=model_with_vocab(tmp_path / "home", 20))
    settings = dataclasses.replace(settings, sampling=SamplingDefaults(stop_token_ids=(20,)))
    said = "sampling.stop_token_ids (--stop-token-ids or the config): token id 20 is outside the model's vocabulary"
    assert_defaults_refused(src, settings, said, tmp_path)
