"""Every field that shapes a completion reaches the engine from a Parquet
column and a JSONL field, with ``passthrough`` on and off (issue 33: with
``passthrough = false`` a Parquet input's ``n``, ``top_k`` and the other
request fields were not read); with it off, the other fields are not copied
to the output (nor, in Parquet, read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fakes import FakeEngine

from bulkinfer.config import load_settings
from bulkinfer.io.output_files import RunPaths
from bulkinfer.jobs.context import RunContext
from bulkinfer.jobs.run import run
from bulkinfer.prep.rows import CONSUMED_FIELDS, SAMPLING_FIELDS
from bulkinfer.schema import Request

# One valid value of every vLLM SamplingParams argument a row sets by its own name (Request.options).
OPTIONS: dict[str, Any] = {
    "n": 3,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "top_k": 5,
    "min_p": 0.05,
    "min_tokens": 2,
    "stop_token_ids": [2, 7],
}
# One valid value of every field a row may set that shapes its completion.
ROW: dict[str, Any] = {
    "id": "r0",
    "prompt": "hello there",
    "max_tokens": 5,
    "temperature": 0.5,
    "top_p": 0.9,
    "seed": 7,
    "stop": ["END"],
    "ignore_eos": True,
    **OPTIONS,
    "logprobs": True,
    "top_logprobs": 2,
    "priority": -3,
    "structured_outputs": {"choice": ["yes", "no"]},  # a struct column
}


class Recording(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Request] = []

    def add(self, request_id: str, request: Request) -> Any:
        self.requests.append(request)
        return super().add(request_id, request)


def test_the_table_above_names_every_sampling_field_a_parquet_column_may_hold() -> None:
    # logit_bias (an object of token ids) and response_format (an object) need map/struct columns; not covered here
    assert set(ROW) - {"id", "prompt"} == SAMPLING_FIELDS - {"logit_bias", "response_format"}
    assert set(ROW) <= CONSUMED_FIELDS


@pytest.mark.parametrize("passthrough", [True, False])
@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_every_sampling_field_reaches_the_engine(tmp_path: Path, suffix: str, passthrough: bool) -> None:
    src = tmp_path / f"in{suffix}"
    row = {**ROW, "reference": "kept only with passthrough"}
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist([row]), src)
    else:
        src.write_bytes(orjson.dumps(row) + b"\n")
    engine = Recording()
    settings = load_settings(None, {"passthrough": passthrough, "engine.scheduling_policy": "priority"})
    result = run(RunPaths.build(src, tmp_path / "out.jsonl"), settings, RunContext(engine_factory=lambda m, s: engine))
    assert result.report["request_counts"]["completed"] == 1
    (request,) = engine.requests
    assert (request.max_tokens, request.temperature, request.top_p, request.seed) == (5, 0.5, 0.9, 7)
    assert (request.stop, request.ignore_eos, request.priority) == (("END",), True, -3)
    assert request.options == {**OPTIONS, "logit_bias": None, "logprobs": 2}  # top_logprobs -> vLLM's logprobs
    assert request.structured == {"choice": ["yes", "no"]}
    assert ("reference" in request.passthrough) == passthrough
    (output,) = [orjson.loads(line) for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert ("reference" in output) == passthrough
