"""What an output is the result of: the input's identity (path, size,
mtime) and the settings that shape results. An interrupted run keeps it in
its journal (``.OUT.journal.json``), a finished run in its report
(``results_of``); ``--resume`` goes on, or finds the output complete, only
for the same input and settings (:func:`check_same_results`)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson

from bulkinfer.config import Settings, option_keys
from bulkinfer.errors import ConfigError


def input_identity(path: Path) -> dict[str, Any]:
    """The input's absolute path, size (bytes) and mtime (ns)."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def file_key(path: Path) -> tuple[int, int]:
    """Which file ``path`` names: its device and inode numbers."""
    st = path.stat()
    return st.st_dev, st.st_ino


def changed_while_read(
    path: Path, identity: dict[str, Any], key: tuple[int, int], read_to: int | None = None
) -> dict[str, Any] | None:
    """How the input at ``path`` changed since ``identity`` and ``key``
    (:func:`input_identity`, :func:`file_key`) were taken, before the run read
    it; None where it did not. ``read_to``: the bytes the reader had read
    when its rows ended (an uncompressed file; None: not known).

    Returns ``{"replaced", "read_whole", "changes", "message"}``.
    ``replaced``: ``path`` now names another file or none (a writer that
    moves a complete file over it); the run read the file it had open.
    Otherwise the file was written while it was read (a writer still
    appending, as a cron line started before it finished finds it), and
    ``read_whole`` says whether the run read it to its present end
    (``read_to`` is its size: every row has its record) or rows written
    after the reader passed them have none (or the file was cut shorter than
    what was read: the message says so). GNU tar reports the same case
    ("file changed as we read it") with exit 1."""
    try:
        now, now_key = input_identity(path), file_key(path)
    except OSError:
        now, now_key = {}, None
    if now == identity and now_key == key:
        return None
    replaced = now_key != key
    read_whole = replaced or read_to == now.get("size")
    changes = input_changes(identity, now) if now else ["removed"]
    said = f"the input {path} {'was replaced after the run opened it' if replaced else 'changed while the run read it'}"
    if replaced:
        message = f"{said} ({'; '.join(changes)}): the output is of the file it read"
    elif read_whole:
        message = f"{said} ({'; '.join(changes)}), and the run read it to its end: every row has its record"
    elif read_to is not None and now and now["size"] < read_to:
        message = (
            f"{said} ({'; '.join(changes)}): it is now shorter than the {read_to} bytes the run read, so the "
            "output holds rows the file no longer has; write an input elsewhere and move it into place when complete"
        )
    else:
        message = (
            f"{said} ({'; '.join(changes)}): rows written to it after the run read past them have no record; "
            "write an input elsewhere and move it into place when complete"
        )
    return {"replaced": replaced, "read_whole": read_whole, "changes": changes, "message": message}


def results_settings(settings: Settings) -> dict[str, Any]:
    """The settings that shape results (model, sampling, engine, pass-through,
    chat template) as JSON data; plan settings (order, windows) and where
    the replicas run (``ray``) may change between attempts."""
    data = settings.to_dict()
    data.pop("plan")
    data.pop("ray")
    loaded: dict[str, Any] = orjson.loads(orjson.dumps(data))  # tuples as lists, as a journal holds them
    return loaded


def settings_fingerprint(settings: Settings) -> str:
    """SHA-256 over :func:`results_settings`."""
    return _sha256(results_settings(settings))


def _sha256(data: dict[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(data, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"sampling": {"seed": 1}}`` -> ``{"sampling.seed": 1}``; the keys of
    ``engine.extra_args`` become ``engine.KEY``."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}" if key != "extra_args" else prefix.rstrip(".")
        if isinstance(value, dict):
            flat.update(_flat(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def settings_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Each setting that differs between two :func:`results_settings`, as
    ``--max-tokens (sampling.max_tokens): 8 -> 16``: the flag that sets it
    (``--engine-arg NAME`` for another vLLM argument), its config key, the
    old and the new value (``not set`` when absent). A setting the old
    record lacks (written by a bulkinfer before the setting existed) is no
    change while it keeps its default."""
    flags = {key: "--" + name.replace("_", "-") for name, key in option_keys().items()}
    old_flat, new_flat = _flat(old), _flat(new)
    defaults = _flat(results_settings(Settings()))
    changes = []
    for key in sorted(set(old_flat) | set(new_flat)):
        before, after = old_flat.get(key, _UNSET), new_flat.get(key, _UNSET)
        if before == after or (before is _UNSET and key in defaults and after == defaults[key]):
            continue
        flag = flags.get(key) or (f"--engine-arg {key.removeprefix('engine.')}" if key.startswith("engine.") else "")
        name = f"{flag} ({key})" if flag else key
        changes.append(f"{name}: {_value(before)} -> {_value(after)}")
    return changes


_UNSET = object()


def _value(value: Any) -> str:
    return "not set" if value is _UNSET else orjson.dumps(value).decode()


def input_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two :func:`input_identity` values, in words:
    ``size 120 -> 140 bytes``, ``modified 2025-01-02 10:00:00 -> ...`` (local
    time), or ``it read OLD, not NEW`` (another path)."""
    if old.get("path") != new.get("path"):
        return [f"it read {old.get('path')}, not {new.get('path')}"]
    changes = []
    if old.get("size") != new.get("size"):
        changes.append(f"size {old.get('size')} -> {new.get('size')} bytes")
    if old.get("mtime_ns") != new.get("mtime_ns"):
        changes.append(f"modified {_when(old.get('mtime_ns'), new.get('mtime_ns'))}")
    return changes or ["its identity record differs"]


def _when(old_ns: Any, new_ns: Any) -> str:
    """Two modification times as local timestamps, to the second, or to the
    microsecond when they fall within the same second."""
    from datetime import datetime

    if not isinstance(old_ns, int) or not isinstance(new_ns, int):
        return f"{old_ns} -> {new_ns}"
    spec = "seconds" if old_ns // 10**9 != new_ns // 10**9 else "microseconds"
    old, new = (datetime.fromtimestamp(ns / 1e9).isoformat(" ", spec) for ns in (old_ns, new_ns))
    return f"{old} -> {new}"


def results_record(identity: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The record of what an output is the result of: ``input`` (an
    :func:`input_identity`), ``settings`` (:func:`results_settings`, with a
    job's own keys) and ``settings_sha256`` over them (sorted keys)."""
    return {"input": identity, "settings_sha256": _sha256(settings), "settings": settings}


def check_same_results(
    out: Path, recorded: dict[str, Any], identity: dict[str, Any], settings: dict[str, Any], complete: bool
) -> None:
    """Refuse to go on with ``out`` (an interrupted run's, or a ``complete``
    one's) for another input or other settings than ``recorded``
    (:func:`results_record`).

    Raises:
        ConfigError: the input's identity or the settings differ; the message
            says what changed and what to do.
    """
    was = "the run that wrote it" if complete else "the interrupted run"
    what = f"cannot resume {out}: {'it is complete, but ' if complete else ''}"
    again = "--overwrite to run it again" if complete else "--overwrite to start over"
    if recorded.get("input") != identity:
        changed = "; ".join(input_changes(recorded.get("input") or {}, identity))
        raise ConfigError(
            f"{what}the input {identity['path']} changed since {was} ({changed}); use the same input, or {again}"
        )
    changes = settings_changes(recorded["settings"], settings) if "settings" in recorded else []
    if recorded.get("settings_sha256") != _sha256(settings) and (changes or "settings" not in recorded):
        which = f": {'; '.join(changes)}" if changes else " (its record does not say which)"
        theirs = "those of the run that wrote it" if complete else "the interrupted run's"
        raise ConfigError(f"{what}settings differ from {theirs}{which}; use the same settings, or {again}")
