"""The tokenizer class ``AutoTokenizer`` chose for a local model directory,
remembered so that the next load skips the choosing
(:func:`bulkinfer.models.load_tokenizer`).

``AutoTokenizer.from_pretrained(model)`` reads ``tokenizer_config.json`` and
``config.json``, picks a class, and returns ``cls.from_pretrained(model)``
(transformers 5, ``models/auto/tokenization_auto.py``; the only other
argument it passes, ``_from_auto``, names the caller in hub requests).
Picking imports transformers' model registry, torch and (where installed)
scikit-learn; the class alone does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bulkinfer.default_model import bulkinfer_home

CHOICES_FILE = "tokenizer-classes.json"  # in bulkinfer_home(): model directory -> {key, module, class}


def choice_key(model: str, trust_remote_code: bool) -> str | None:
    """What AutoTokenizer's choice of class for ``model`` depends on, hashed:
    transformers' version, ``trust_remote_code``, the names of the files in
    the directory (a ``tokenizer.model``, ``tekken.json`` or ``*.py`` beside
    the configs changes the choice) and the bytes of ``tokenizer_config.json``
    and ``config.json``. None for a hub id (the hub may change under it)."""
    import hashlib
    from importlib.metadata import version

    directory = Path(model)
    try:
        names = sorted(entry.name for entry in directory.iterdir())
        digest = hashlib.sha256(f"{version('transformers')}\0{trust_remote_code}\0{names}".encode())
        for name in ("tokenizer_config.json", "config.json"):
            if name in names:
                digest.update(name.encode() + b"\0" + (directory / name).read_bytes())
    except OSError:  # not a directory (a hub id), or unreadable: AutoTokenizer says what is wrong
        return None
    return digest.hexdigest()


def _read_choices() -> dict[str, Any]:
    import json

    try:
        choices = json.loads((bulkinfer_home() / CHOICES_FILE).read_bytes())
    except (OSError, ValueError):  # none yet, or torn: chosen again
        return {}
    return choices if isinstance(choices, dict) else {}


def remembered_class(model: str, key: str | None) -> Any:
    """The tokenizer class AutoTokenizer chose for ``model`` under the same
    ``key``, imported; None when none is remembered or it cannot be imported."""
    import importlib

    entry = _read_choices().get(str(Path(model).resolve())) if key is not None else None
    if not isinstance(entry, dict) or entry.get("key") != key:
        return None
    try:
        return getattr(importlib.import_module(str(entry["module"])), str(entry["class"]))
    except (ImportError, AttributeError, KeyError):
        return None


def remember_class(model: str, key: str | None, cls: type) -> None:
    """Keep AutoTokenizer's choice for ``model``: a class of transformers' own
    (not remote code), written atomically; a home that cannot be written to
    keeps nothing (the next load chooses again)."""
    import json

    from bulkinfer.io.files import atomic_write

    if key is None or not cls.__module__.startswith("transformers."):
        return
    choices = _read_choices()
    choices[str(Path(model).resolve())] = {"key": key, "module": cls.__module__, "class": cls.__qualname__}
    try:
        bulkinfer_home().mkdir(parents=True, exist_ok=True)
        atomic_write(bulkinfer_home() / CHOICES_FILE, json.dumps(choices, indent=1).encode())
    except OSError:
        pass
