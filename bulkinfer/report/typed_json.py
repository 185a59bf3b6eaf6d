"""JSON objects as frozen dataclasses, checked: each field read from its key
(or ``field(metadata={"key": "a.b"})``, a dotted path), converted to the
field's type (a dataclass, ``list[T]``, ``dict[str, T]``, ``X | None``,
``Any``, or a JSON scalar; an integer is a float, true is no integer); a
missing key takes the field's default. What is wrong is an
:class:`~bulkinfer.errors.InputFileError` naming the file and the key, e.g.
``r.report.json: not a saved OUT.report.json: key 'seconds.generate' is missing``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

from bulkinfer.errors import InputFileError


@dataclass(frozen=True, slots=True)
class Where:
    """Where a value sits, for the error message: the file, the kind of report, the key."""

    source: str
    kind: str
    key: str = ""

    def at(self, key: str) -> Where:
        return Where(self.source, self.kind, f"{self.key}.{key}" if self.key else key)

    def error(self, what: str) -> InputFileError:
        return InputFileError(f"{self.source}: not a saved {self.kind}: key '{self.key}' {what}")


_MISSING = object()


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    value: Any = data
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def from_json(cls: type[Any], data: dict[str, Any], where: Where) -> Any:
    """An instance of the dataclass ``cls`` from the JSON object ``data``
    (``where`` it was read: file, kind, key).

    Raises:
        InputFileError: a key without a default is missing, or a value is not
            of its field's type (the message names the file and the key).
    """
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        key = f.metadata.get("key", f.name)
        value = _lookup(data, key)
        if value is _MISSING:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise where.at(key).error("is missing")
            continue
        values[f.name] = _convert(hints[f.name], value, where.at(key))
    return cls(**values)


_NAMES: dict[Any, str] = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    type(None): "null",
}


def _convert(hint: Any, value: Any, where: Where) -> Any:
    """``value`` as the type ``hint``: a dataclass, list[T], dict[str, T],
    a union (``X | None``), Any, or a JSON scalar (an integer is a float)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is not type(None) and _matches(option, value):
                return _convert(option, value, where)
        raise where.error(f"is {_json_type(value)}, not {' or '.join(_describe(o) for o in options)}")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise where.error(f"is {_json_type(value)}, not an object")
        return from_json(typing.cast(type[Any], hint), value, where)
    if origin is list:
        if not isinstance(value, list):
            raise where.error(f"is {_json_type(value)}, not a list")
        (item,) = typing.get_args(hint)
        return [_convert(item, v, where.at(str(i))) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise where.error(f"is {_json_type(value)}, not an object")
        item = typing.get_args(hint)[1]
        return {k: _convert(item, v, where.at(k)) for k, v in value.items()}
    if not _matches(hint, value):
        raise where.error(f"is {_json_type(value)}, not {_describe(hint)}")
    return float(value) if hint is float else value


def _matches(hint: Any, value: Any) -> bool:
    """Whether ``value`` has the JSON shape of ``hint`` (without looking inside)."""
    if dataclasses.is_dataclass(hint) or typing.get_origin(hint) is dict:
        return isinstance(value, dict)
    if typing.get_origin(hint) is list:
        return isinstance(value, list)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return hint is Any or isinstance(value, hint)


def _describe(hint: Any) -> str:
    """A type hint as a JSON type, for a message: "an object", "a list", "an integer", ..."""
    if dataclasses.is_dataclass(hint) or dict in (hint, typing.get_origin(hint)):
        return "an object"
    if list in (hint, typing.get_origin(hint)):
        return "a list"
    return _NAMES.get(hint, str(hint))


def _json_type(value: Any) -> str:
    """What a JSON value is, in the words of :func:`_describe`."""
    return _describe(type(value)) if type(value) in (dict, list) else _NAMES.get(type(value), type(value).__name__)
