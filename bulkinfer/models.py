"""Model names resolved to what vLLM loads, the prepared models listed, and
the tokenizer loaded. The default model's preparation is
:mod:`bulkinfer.default_model`.
"""

from __future__ import annotations

import functools
import os
import re
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bulkinfer.default_model import (
    DEFAULT_ENCODER,
    DEFAULT_MODEL,
    _read_marker,
    bulkinfer_home,
    prepare_default_encoder,
    prepare_default_model,
)
from bulkinfer.errors import BulkinferError, ModelError
from bulkinfer.tokenizer_choice import choice_key, remember_class, remembered_class

# (model path, trust_remote_code) -> a Hugging Face tokenizer: load_tokenizer, or a test's own
TokenizerFactory = Callable[[str, bool], Any]

# transformers' lazy module is not safe to import from two threads at once (two
# runs of the Python API: "cannot import name 'AutoTokenizer' from 'transformers'");
# tokenizers load one at a time.
_TRANSFORMERS_IMPORT = threading.Lock()

# Weight files vLLM's default loader picks up from a directory ("hf" format:
# *.safetensors, *.bin; *.pt as a fallback), see DefaultModelLoader in
# vllm/model_executor/model_loader/default_loader.py.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_WEIGHTS_SHOWN = "*.safetensors or *.bin"
_WHAT_TO_GIVE = (
    "give a local Hugging Face model directory (config.json + weights), "
    "a prepared model name (bulkinfer models), or a hub id org/name"
)
# An org/name id on the Hugging Face hub: no leading dot or slash, one slash.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A prepared model under ``$BULKINFER_HOME/models/``.

    Attributes:
        name: directory name, which is also the name ``resolve_model`` takes.
        path: absolute path of the model directory.
        size_bytes: total size of the model files in bytes.
        created: when the conversion finished (UTC).
        source: file name of the GGUF (or zip) it was prepared from.
        task: ``generate`` (an LLM, for ``bulkinfer run``) or ``embed`` (an
            encoder, for ``bulkinfer embed``).
    """

    name: str
    path: Path
    size_bytes: int
    created: datetime
    source: str
    task: str = "generate"


def resolve_model(model: str | None, home: Path | None = None) -> str:
    """Turn a user's model name into what ``vllm.LLM(model=...)`` takes.

    Args:
        model: None or ``DEFAULT_MODEL`` for the default model;
            ``DEFAULT_ENCODER`` for the default embedding model; the name of
            another prepared model (see ``list_models``); a local model
            directory; or a Hugging Face hub id such as ``org/name``.
        home: bulkinfer's data directory; ``bulkinfer_home()`` when None.

    Returns:
        The real (symlinks resolved) absolute path of a local model directory, or the hub id as given
        (a string that looks like ``org/name`` and is not a local path).

    A path-like ``model`` (see ``_is_path_like``) that does not exist is an
    error at once, never passed on as a hub id; a local directory must hold
    ``config.json`` and weights; a hub id must be in the local Hugging Face
    cache or known to the hub (one metadata request, none when
    ``HF_HUB_OFFLINE`` is set). Nothing is downloaded or loaded here.

    Raises:
        ModelError: the name is none of the above (the message names the path
            and what to give instead); a local directory is unreadable, has no
            ``config.json`` or no weights; a hub id is neither cached nor
            found on the hub; or the default model cannot be prepared.
    """
    # every local model as its real path: one model, one key in the calibration store
    if model is None or model == DEFAULT_MODEL:
        return str(prepare_default_model(home).resolve())
    if model == DEFAULT_ENCODER:
        return str(prepare_default_encoder(home).resolve())
    if not model.strip():
        raise ModelError(f"unknown model {model!r}: the model name is empty; {_WHAT_TO_GIVE}")
    local = Path(model).expanduser()
    kind = _path_kind(local)
    if kind == "dir":
        _check_model_dir(local)
        return str(local.resolve())
    if kind == "other":
        raise ModelError(
            f"model {model!r} is a file ({_absolute(local)}); expected a model directory "
            f"(config.json and weights: {_WEIGHTS_SHOWN}); {_WHAT_TO_GIVE}"
        )
    if "/" not in model:
        models_dir = (home if home is not None else bulkinfer_home()) / "models"
        if _read_marker(models_dir / model) is not None:
            return str((models_dir / model).resolve())
    if _is_path_like(model):
        raise ModelError(f"no such model directory: {_absolute(local)}; {_WHAT_TO_GIVE}")
    if _HUB_ID.match(model):
        _check_hub_model(model)
        return model
    raise ModelError(
        f"unknown model {model!r}: not a local directory or a prepared model "
        f"(default: {DEFAULT_MODEL!r}); {_WHAT_TO_GIVE}"
    )


_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _offline() -> str | None:
    """The environment variable that keeps Hugging Face libraries off the network, if one is set."""
    for name in _OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return name
    return None


@functools.lru_cache(maxsize=64)  # a found id is not asked for twice in one process; errors are not cached
def _check_hub_model(model: str) -> None:
    """Check, in at most a few seconds, that the hub id ``model`` can be
    loaded: its ``config.json`` is in the local Hugging Face cache, or (when
    not offline) the hub answers one metadata request for it. Downloads nothing;
    transformers and vLLM would otherwise retry for many seconds, then fail
    with a traceback.

    Raises:
        ModelError: not cached and offline (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``),
            no such repository (or gated, or private), or the hub cannot be reached.
    """
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(huggingface_hub.try_to_load_from_cache(model, "config.json"), str):
        return
    cache = huggingface_hub.constants.HF_HUB_CACHE
    offline = _offline()
    if offline is not None:
        raise ModelError(
            f"model {model!r} is not in the local Hugging Face cache ({cache}) and {offline} is set, so it "
            f"cannot be downloaded; download it first (hf download {model}), or {_WHAT_TO_GIVE}"
        )
    try:
        huggingface_hub.model_info(model, timeout=10)
    except GatedRepoError:
        raise ModelError(
            f"model {model!r} is gated on the Hugging Face hub: accept its terms on huggingface.co and log in "
            "(hf auth login), or give a local model directory"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"no model {model!r} on the Hugging Face hub (or it is private) and none in the local cache "
            f"({cache}); {_WHAT_TO_GIVE}"
        ) from None
    except Exception as exc:  # the transport's own errors (requests, httpx, httpx2 by hub version)
        raise ModelError(
            f"model {model!r} is not in the local Hugging Face cache ({cache}) and the hub cannot be reached "
            f"({type(exc).__name__}: {exc}); check the network, or {_WHAT_TO_GIVE}"
        ) from None


def _is_path_like(model: str) -> bool:
    """True when ``model`` can only be meant as a local path, never a hub id.

    That is: it starts with ``/``, ``./``, ``../`` or ``~``, ends with ``/``,
    has more than one ``/``, has a ``/`` but is no valid ``org/name``, or its
    first component is a local directory (``models/mine`` when ``./models``
    exists). A plain ``org/name`` whose ``org`` is not a local directory is a
    hub id.
    """
    if model.startswith(("/", "./", "../", "~")) or model.endswith("/") or model.count("/") > 1:
        return True
    if "/" not in model:
        return False
    return not _HUB_ID.match(model) or os.path.isdir(model.split("/", 1)[0])


def _absolute(path: Path) -> str:
    """``path`` made absolute and normalized (``..`` folded), without following links."""
    return os.path.abspath(path)


def _path_kind(path: Path) -> str | None:
    """``"dir"``, ``"other"`` (a file or anything not a directory) or None if nothing is there.

    Raises:
        ModelError: the path cannot be looked at (a parent without search
            permission, a symlink loop, a name too long, ...).
    """
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise ModelError(f"cannot read model path {_absolute(path)}: {exc.strerror or exc}") from None
    return "dir" if stat.S_ISDIR(mode) else "other"


def _check_model_dir(path: Path) -> None:
    """Check that the directory ``path`` holds a model vLLM can load.

    A Hugging Face model directory has ``config.json`` and weights in files
    vLLM's default loader looks for (``*.safetensors``, ``*.bin``, or
    ``*.pt`` as its fallback). Only names are listed; no file is read beyond
    opening ``config.json``.

    Raises:
        ModelError: the directory cannot be listed or ``config.json`` cannot
            be opened (permissions), there is no ``config.json``, or no weights.
    """
    where = _absolute(path)
    try:
        names = os.listdir(path)
    except OSError as exc:
        raise ModelError(
            f"cannot read model directory {where}: {exc.strerror or exc}; "
            "check its permissions (read and search) for this user"
        ) from None
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if "config.json" not in names:
        gguf_hint = (
            f"; it holds {', '.join(ggufs[:3])}: convert a GGUF into such a directory first "
            "(transformers: from_pretrained(dir, gguf_file=...), then save_pretrained)"
            if ggufs
            else ""
        )
        raise ModelError(
            f"{where} holds no model: no config.json; expected a Hugging Face model directory with "
            f"config.json and weights ({_WEIGHTS_SHOWN}){gguf_hint}; {_WHAT_TO_GIVE}"
        )
    try:
        with open(path / "config.json", "rb"):
            pass
    except OSError as exc:
        raise ModelError(
            f"cannot read {where}/config.json: {exc.strerror or exc}; check the permissions of the model directory"
        ) from None
    if not any(name.endswith(_WEIGHT_SUFFIXES) for name in names):
        found = f"; it holds {', '.join(ggufs[:3])}, which vLLM does not load from a directory" if ggufs else ""
        raise ModelError(
            f"{where} has config.json but no weights: expected {_WEIGHTS_SHOWN} files next to it{found}; "
            "copy the weights into the directory (an interrupted download or copy leaves this state)"
        )


def list_models(home: Path | None = None) -> list[ModelInfo]:
    """List the prepared models under ``home/models/``, sorted by name.

    Only directories with a valid marker count: a temporary directory left
    by an interrupted conversion is not a model.

    Args:
        home: bulkinfer's data directory; ``bulkinfer_home()`` when None.

    Returns:
        One ``ModelInfo`` per prepared model; empty if there are none.
    """
    models_dir = (home if home is not None else bulkinfer_home()) / "models"
    if not models_dir.is_dir():
        return []
    found = []
    for entry in sorted(models_dir.iterdir()):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        marker = _read_marker(entry)
        if marker is None:
            continue
        found.append(
            ModelInfo(
                name=entry.name,
                path=entry.resolve(),
                size_bytes=marker["size_bytes"],
                created=datetime.fromisoformat(marker["created"]),
                source=marker["source_file"],
                task=marker.get("task", "generate"),
            )
        )
    return found


def load_tokenizer(model: str, trust_remote_code: bool = False) -> Any:
    """The model's Hugging Face tokenizer: ``AutoTokenizer.from_pretrained``'s.

    AutoTokenizer chooses a class (from ``tokenizer_config.json``,
    ``config.json`` and the files beside them) and returns that class's
    ``from_pretrained(model)``. Choosing imports transformers' model
    registry, torch and (where installed) scikit-learn. For a local
    directory the class is remembered in
    ``$BULKINFER_HOME/tokenizer-classes.json``
    (:mod:`bulkinfer.tokenizer_choice`) and called directly the next time:
    the same class, the same call, the same tokenizer. The default model's
    load in a fresh process took 10.0-15.4 s before, 2.5-4.5 s with the
    class remembered (AMD EPYC Zen 3, ``bench/results/tokenizer-load-zen3.md``).

    Raises:
        ModelError: transformers cannot load a tokenizer from ``model``.
    """
    try:
        with _TRANSFORMERS_IMPORT:
            key = choice_key(model, trust_remote_code)
            remembered = remembered_class(model, key)
            if remembered is not None:
                return remembered.from_pretrained(model)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
            remember_class(model, key, type(tokenizer))
            return tokenizer
    except BulkinferError:  # a stop signal's Interrupted, raised wherever the load was: not the tokenizer's fault
        raise
    except Exception as exc:  # OSError, ValueError, KeyError, ImportError, the hub transport's own errors
        raise ModelError(f"cannot load the tokenizer of {model}: {type(exc).__name__}: {exc}") from None


# sentence-transformers module types whose presence in modules.json means L2
# normalisation (the names vLLM's get_pooling_config looks for, by suffix).
_NORMALIZE_SUFFIX = ".Normalize"


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """What an embedding model's sentence-transformers config says.

    Attributes:
        max_seq_length: tokens (special tokens included) an input may have:
            ``sentence_bert_config.json``'s ``max_seq_length``, else the
            tokenizer's ``model_max_length`` (when below 10**6), else
            ``config.json``'s ``max_position_embeddings``; None when none is given.
        normalize: whether vectors are L2-normalized: a ``Normalize`` module
            in ``modules.json``; None without a ``modules.json`` (vLLM's
            default for the model then applies).
    """

    max_seq_length: int | None
    normalize: bool | None


def encoder_config(model: str) -> EncoderConfig:
    """The :class:`EncoderConfig` of the local model directory ``model``
    (both fields None for a hub id or unreadable files: vLLM's own defaults)."""
    import json

    directory = Path(model)

    def read(name: str) -> Any:
        try:
            return json.loads((directory / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    modules = read("modules.json")
    normalize = None
    if isinstance(modules, list):
        normalize = any(str(m.get("type", "")).endswith(_NORMALIZE_SUFFIX) for m in modules if isinstance(m, dict))
    length = None
    for name, key in (
        ("sentence_bert_config.json", "max_seq_length"),
        ("tokenizer_config.json", "model_max_length"),
        ("config.json", "max_position_embeddings"),
    ):
        value = (read(name) or {}).get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 10**6:
            length = value
            break
    return EncoderConfig(length, normalize)


def model_task(model_path: str) -> str:
    """What the resolved model ``model_path`` does: ``embed`` for a prepared
    encoder (its marker's ``task``) or a local sentence-transformers
    directory (a ``modules.json``: the file vLLM reads an embedding model's
    pooling from), else ``generate`` (a hub id is not looked into)."""
    path = Path(model_path)
    marker = _read_marker(path)
    if marker is not None:
        return str(marker.get("task", "generate"))
    return "embed" if (path / "modules.json").is_file() else "generate"
