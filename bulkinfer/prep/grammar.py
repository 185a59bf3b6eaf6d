"""Structured outputs vLLM's grammar backend would refuse, found before the engine.

A row's ``structured_outputs`` (or the ``response_format`` it came from)
passes bulkinfer's own checks of its shape (:func:`bulkinfer.fields.structured_problem`:
one kind, a valid JSON schema), but whether a ``regex`` or ``grammar``
compiles, or a schema uses only what a backend supports, is for vLLM's
structured-output backend to say; it says so as the request is added
(``SamplingParams.verify`` in vLLM's input processor), after the engine has
started, and ``plan`` could not count it. :class:`Grammars` asks the same
function, ``SamplingParams._validate_structured_outputs`` (vLLM 0.32), with
the engine's ``StructuredOutputsConfig`` (``[engine]
structured_outputs_config``; its ``backend`` ``auto`` by default: xgrammar,
falling back to guidance or outlines as vLLM chooses), so a row is refused
exactly when vLLM would refuse it, naming its field and keeping vLLM's
message. vLLM is imported at the first structured row (a few seconds in a
process without an engine, as ``plan``'s); each distinct structured value is
asked once.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import orjson

from bulkinfer.config import SamplingDefaults, structured_outputs_config
from bulkinfer.settings import EngineSettings

ASKED = 4096  # distinct structured values whose answer is kept (the oldest forgotten first)


class Grammars:
    """Whether vLLM's structured-output backend takes a request's
    ``structured`` value (the arguments of vLLM's ``StructuredOutputsParams``).

    Args:
        tokenizer: the model's tokenizer, as the engine's (the guidance
            backend needs a fast one).
        engine: the run's engine settings: ``extra_args["structured_outputs_config"]``
            (a table of ``StructuredOutputsConfig`` fields) chooses the backend.
    """

    def __init__(self, tokenizer: Any, engine: EngineSettings):
        self.tokenizer = tokenizer
        self.config: Any = engine.extra_args.get("structured_outputs_config") or {}
        self._asked: dict[bytes, str | None] = {}

    def problem(self, request: Any) -> str | None:
        """What vLLM would refuse in ``request.structured`` (a
        :class:`~bulkinfer.schema.Request`), naming the row's field
        (``"field 'structured_outputs': Grammar error: ... invalid regex"``;
        ``response_format`` when the row gave that; "(the [sampling]
        default)" when it gave neither), or None."""
        if request.structured is None:
            return None
        said = self.refusal(request.structured)
        if said is None:
            return None
        given = [name for name in ("structured_outputs", "response_format") if name in request.row_sampling]
        named = given[0] if given else "structured_outputs (the [sampling] default)"
        return f"field '{named}': {said}"

    def defaults_problem(self, sampling: SamplingDefaults) -> str | None:
        """What vLLM would refuse in the ``[sampling]`` default structured
        output (``--json-schema``, ``--choice``, ``--regex`` or the config:
        every row that leaves it to the default would fail), naming the
        setting, or None."""
        if not sampling.structured_outputs:
            return None
        said = self.refusal(sampling.structured_outputs)
        flags = "--json-schema, --choice, --regex or the config"
        return f"sampling.structured_outputs ({flags}): {said}" if said else None

    def refusal(self, structured: Mapping[str, Any]) -> str | None:
        """vLLM's message refusing ``structured`` with this engine's backend,
        or None when vLLM takes it (asked once per distinct value).

        Raises:
            ConfigError: ``[engine] structured_outputs_config`` is not one
                vLLM's ``StructuredOutputsConfig`` takes.
        """
        key = orjson.dumps(structured, option=orjson.OPT_SORT_KEYS)
        if key not in self._asked:
            if len(self._asked) >= ASKED:
                del self._asked[next(iter(self._asked))]
            self._asked[key] = self._ask(structured)
        return self._asked[key]

    def _ask(self, structured: Mapping[str, Any]) -> str | None:
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams

        config = structured_outputs_config(self.config)
        model = SimpleNamespace(is_diffusion=False)  # the one ModelConfig field the check reads
        try:
            params = SamplingParams(structured_outputs=StructuredOutputsParams(**structured))
            params._validate_structured_outputs(model, config, self.tokenizer)  # type: ignore[arg-type]
        except (VLLMClientError, ValueError) as exc:  # VLLMValidationError, or a backend's ValueError
            return str(exc)
        except Exception:  # noqa: BLE001 (not a refusal: the engine, which checks again, says what it is)
            return None
        return None
