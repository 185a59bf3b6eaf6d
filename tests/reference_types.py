"""Output lines checked against the reference implementations: vLLM's
``BatchRequestOutput`` for the line, the ``openai`` SDK's ``ChatCompletion``
/ ``Completion`` for its body. (vLLM 0.32's batch runner has no
``/v1/completions``: its ``BatchRequestOutput`` body union lacks
``CompletionResponse``, so such a line's envelope is checked with the body
apart.)"""

from __future__ import annotations

from typing import Any

import pytest


def check_openai_line(record: dict[str, Any]) -> Any:
    """Validate one output or error line of an OpenAI batch; the parsed
    ``BatchRequestOutput``. Raises pydantic's ValidationError on a bad line."""
    run_batch = pytest.importorskip("vllm.entrypoints.launchers.run_batch")
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    response = record.get("response")
    if response is not None and response["body"]["object"] == "text_completion":
        Completion.model_validate(response["body"])
        record = {**record, "response": {**response, "body": None}}  # not in vLLM 0.32's union
    elif response is not None:
        ChatCompletion.model_validate(response["body"])
    return run_batch.BatchRequestOutput.model_validate(record)
