"""The compile cache's key does not depend on which module imported torch first
(bulkinfer/engine/compile_key.py): hashed by torch inductor's own cache pickler,
in fresh interpreters that import in either order."""

from __future__ import annotations

import copyreg
import importlib.metadata
import pickle
import subprocess
import sys

import pytest
import torch

from bulkinfer.engine import compile_key

# Prints the FX graph cache's hash of a contiguous tensor's metadata, as inductor keys a compiled graph's inputs.
# argv[1]: "tokenizer-first" imports torch through transformers, as loading a tokenizer does; argv[2]: "stable"
# registers bulkinfer's reducer first.
HASH_SCRIPT = """
import sys
if sys.argv[1] == "tokenizer-first":
    import transformers.image_processing_utils_fast
import torch
if sys.argv[2] == "stable":
    from bulkinfer.engine.compile_key import stable_memory_format_pickle
    stable_memory_format_pickle()
from torch._inductor.codecache import FxGraphCachePickler, extract_tensor_metadata_for_cache_key
meta = extract_tensor_metadata_for_cache_key(torch.zeros(2, 3))
assert meta.memory_format is torch.contiguous_format, meta
print(FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())).get_hash(meta))
"""


def _hash(order: str, mode: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", HASH_SCRIPT, order, mode], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_key_is_the_same_whichever_module_imported_torch_first():
    assert _hash("torch-first", "stable") == _hash("tokenizer-first", "stable")


def test_without_it_the_import_order_changes_the_key():
    # The defect itself, with torch 2.13: if this fails, torch pickles memory_format by one name now and
    # compile_key can go.
    assert _hash("torch-first", "plain") != _hash("tokenizer-first", "plain")


def test_a_memory_format_still_unpickles_to_itself_without_bulkinfer(monkeypatch):
    monkeypatch.setattr(copyreg, "dispatch_table", dict(copyreg.dispatch_table))
    compile_key.stable_memory_format_pickle()
    for value in (torch.contiguous_format, torch.channels_last, torch.preserve_format):
        data = pickle.dumps(value)
        assert b"bulkinfer" not in data
        assert pickle.loads(data) is value


@pytest.mark.parametrize("env, registered", [(None, False), ("1", True)])
def test_the_vllm_plugin_acts_only_in_processes_bulkinfer_started(monkeypatch, env, registered):
    monkeypatch.setattr(copyreg, "dispatch_table", dict(copyreg.dispatch_table))
    copyreg.dispatch_table.pop(torch.memory_format, None)
    if env is None:
        monkeypatch.delenv(compile_key.ENV, raising=False)
    else:
        monkeypatch.setenv(compile_key.ENV, env)
    compile_key.register()
    assert (torch.memory_format in copyreg.dispatch_table) is registered


def test_vllm_finds_the_plugin():
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert {p.name: p.value for p in plugins}.get("bulkinfer_compile_key") == "bulkinfer.engine.compile_key:register"
