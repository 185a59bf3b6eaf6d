"""vLLM's pooling outputs joined into one Completion per embedding request:
inputs finishing in any order, a failed input failing the request, the
engine ids of an abort."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bulkinfer.engine.sampling import StreamedOutputs


def pooled(request_id: str, vector: list[float], tokens: int, error: object = None) -> SimpleNamespace:
    """A vLLM ``PoolingRequestOutput`` as the engine returns it, finished."""
    data = SimpleNamespace(data=torch.tensor(vector, dtype=torch.float32))
    return SimpleNamespace(
        request_id=request_id, outputs=data, prompt_token_ids=[0] * tokens, finished=True, error=error
    )


def test_the_inputs_of_a_request_come_back_as_one_completion_in_input_order() -> None:
    outputs = StreamedOutputs()
    outputs.expect_embeddings("7", ["7#0", "7#1"])
    assert outputs.completions([pooled("7#1", [0.5, 0.25], 3)]) == []
    [done] = outputs.completions([pooled("7#0", [1.0, 0.0], 4)])
    assert done.request_id == "7" and done.error is None
    assert done.embeddings == ([1.0, 0.0], [0.5, 0.25])
    assert (done.prompt_tokens, done.completion_tokens, outputs.prefilled_tokens) == (7, 0, 7)
    assert outputs.part_of == {}


def test_a_failed_input_fails_its_request() -> None:
    outputs = StreamedOutputs()
    outputs.expect_embeddings("1", ["1#0", "1#1"])
    outputs.completions([pooled("1#0", [1.0], 2, error="too long")])
    [done] = outputs.completions([pooled("1#1", [1.0], 2)])
    assert done.error == "too long" and done.embeddings is None


def test_an_abort_names_every_input_and_forgets_them() -> None:
    outputs = StreamedOutputs()
    outputs.expect_embeddings("1", ["1#0", "1#1", "1#2"])
    outputs.expect_embeddings("2", ["2#0"])
    assert outputs.engine_ids(["1", "9"]) == ["1#0", "1#1", "1#2", "9"]
    outputs.forget(["1"])
    assert set(outputs.part_of) == {"2#0"}
