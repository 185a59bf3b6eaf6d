"""How the structured rows came back: each completion of a row with a
constraint (vLLM's ``StructuredOutputsParams``) checked against it.

The grammar vLLM decodes with guarantees a completion that ran to its end;
one cut at ``max_tokens`` (``finish_reason: length``) may stop before the
JSON closes or the pattern completes. Checks: ``json`` parses and validates
under its schema (the ``jsonschema`` library), ``json_object`` parses to an
object, ``choice`` is one of the choices, ``regex`` matches whole (Python's
``re``, whose syntax the common patterns share with vLLM's grammar
backends); a ``grammar`` (EBNF) is not re-checked.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import orjson

from bulkinfer.fields import STRUCTURED_KINDS

# Distinct schemas whose compiled validators are kept (a job has one or a few).
VALIDATORS_KEPT = 64


class StructuredStats:
    """Counts, per constraint kind, the completions checked (``completions``),
    ``valid``, ``cut_at_max_tokens`` (not valid, ``finish_reason`` length),
    ``invalid`` (not valid though it ended by itself) and ``unchecked``
    (grammar)."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter[str]] = {}
        self._validators: dict[bytes, Any] = {}

    def add(self, structured: dict[str, Any], text: str, finish_reason: str) -> None:
        """One completion of a row constrained by ``structured`` (the
        ``StructuredOutputsParams`` arguments)."""
        kind = next(k for k in STRUCTURED_KINDS if structured.get(k) is not None)
        counts = self.counts.setdefault(kind, Counter())
        counts["completions"] += 1
        valid = self._valid(kind, structured[kind], text)
        if valid is None:
            counts["unchecked"] += 1
        elif valid:
            counts["valid"] += 1
        elif finish_reason == "length":
            counts["cut_at_max_tokens"] += 1
        else:
            counts["invalid"] += 1

    def _valid(self, kind: str, spec: Any, text: str) -> bool | None:
        if kind == "choice":
            return text in spec
        if kind == "regex":
            try:
                return re.fullmatch(spec, text) is not None
            except re.error:  # a pattern Python's re does not read
                return None
        if kind == "grammar":
            return None
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        return bool(self._validator(spec).is_valid(value))

    def _validator(self, schema: Any) -> Any:
        import jsonschema

        key = schema.encode() if isinstance(schema, str) else orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
        validator = self._validators.get(key)
        if validator is None:
            parsed = orjson.loads(schema) if isinstance(schema, str) else schema
            validator = jsonschema.validators.validator_for(parsed)(parsed)
            if len(self._validators) >= VALIDATORS_KEPT:
                self._validators.pop(next(iter(self._validators)))
            self._validators[key] = validator
        return validator

    def to_dict(self, backend: str | None) -> dict[str, Any] | None:
        """The report's ``structured_outputs``: ``backend`` (vLLM's grammar
        backend that ran, e.g. ``xgrammar``) and the counts by kind; None
        when no row had a constraint."""
        if not self.counts:
            return None
        keys = ("completions", "valid", "cut_at_max_tokens", "invalid", "unchecked")
        return {
            "backend": backend,
            "by_kind": {kind: {k: counts[k] for k in keys} for kind, counts in sorted(self.counts.items())},
        }
