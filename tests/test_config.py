"""Tests of bulkinfer.config: defaults < TOML file < CLI overrides, and validation."""

from __future__ import annotations

import dataclasses
import errno
import os
import re
from pathlib import Path

import orjson
import pytest

from bulkinfer.config import DEFAULT_BUCKETS, EngineSettings, PlanSettings, SamplingDefaults, Settings, load_settings
from bulkinfer.errors import EXIT_INPUT, EXIT_USAGE, ConfigError, InputFileError

REPO = Path(__file__).resolve().parents[1]


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "settings.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_without_file_or_overrides() -> None:
    settings = load_settings()
    assert settings == Settings()
    assert settings.model is None
    assert settings.passthrough is True
    assert settings.sampling.max_tokens == 256
    assert settings.sampling.temperature == 1.0
    assert settings.sampling.stop == ()
    assert settings.engine.dtype == "auto"
    assert settings.engine.max_num_seqs is None
    assert settings.plan.buckets == DEFAULT_BUCKETS
    assert settings.plan.order == "descending"
    assert settings.plan.padding_batch_size == 16


def test_toml_values_are_read(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        """
model = "my-model"
passthrough = false
[sampling]
max_tokens = 64
temperature = 0.0
stop = ["###", "END"]
seed = 7
[engine]
dtype = "float32"
max_num_seqs = 8
[plan]
order = "ascending"
window_rows = 100
""",
    )
    settings = load_settings(path)
    assert settings.model == "my-model"
    assert settings.passthrough is False
    assert settings.sampling == SamplingDefaults(max_tokens=64, temperature=0.0, stop=("###", "END"), seed=7)
    assert settings.engine.dtype == "float32"
    assert settings.engine.max_num_seqs == 8
    assert settings.engine.tensor_parallel_size == 1  # untouched key keeps its default
    assert settings.plan.order == "ascending"
    assert settings.plan.window_rows == 100
    assert settings.plan.buckets == DEFAULT_BUCKETS


def test_cli_overrides_win_over_toml(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        'model = "from-toml"\n[sampling]\nmax_tokens = 64\ntemperature = 0.5\n[engine]\ndtype = "bfloat16"\n',
    )
    settings = load_settings(
        path, {"model": "from-cli", "sampling.max_tokens": 12, "engine.dtype": "float32", "plan.order": "arrival"}
    )
    assert settings.model == "from-cli"
    assert settings.sampling.max_tokens == 12
    assert settings.sampling.temperature == 0.5  # from the TOML, not overridden
    assert settings.engine.dtype == "float32"
    assert settings.plan.order == "arrival"


def test_none_overrides_are_ignored(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'model = "from-toml"\n[sampling]\nmax_tokens = 64\n')
    settings = load_settings(path, {"model": None, "sampling.max_tokens": None, "engine.max_num_seqs": None})
    assert settings.model == "from-toml"
    assert settings.sampling.max_tokens == 64
    assert settings.engine.max_num_seqs is None


def test_buckets_list_becomes_tuple(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[plan]\nbuckets = [8, 64, 512]\n")
    settings = load_settings(path)
    assert settings.plan.buckets == (8, 64, 512)
    assert isinstance(settings.plan.buckets, tuple)
    from_cli = load_settings(None, {"plan.buckets": [4, 40]})
    assert from_cli.plan.buckets == (4, 40)
    assert isinstance(from_cli.plan.buckets, tuple)
    # frozen settings are hashable only when every field is (a list would not be)
    hash(from_cli.plan)


def test_settings_are_frozen() -> None:
    settings = load_settings()
    with pytest.raises(AttributeError):
        settings.model = "x"  # type: ignore[misc]


def test_unknown_key_in_section_is_named(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[sampling]\nmax_tokens = 5\nmax_tokenz = 5\n")
    with pytest.raises(ConfigError, match="max_tokenz") as info:
        load_settings(path)
    assert "[sampling]" in str(info.value)
    assert info.value.exit_code == EXIT_USAGE


def test_other_engine_keys_are_vllm_engine_args(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[engine]\nmax_num_seqs = 8\nenable_prefix_caching = false\nkv_cache_dtype = "fp8"\n')
    settings = load_settings(path, {"engine.max_num_batched_tokens": 512, "engine.quantization": "fp8"})
    assert settings.engine.max_num_seqs == 8 and settings.engine.max_num_batched_tokens == 512  # typed, checked here
    assert settings.engine.extra_args == {
        "enable_prefix_caching": False,
        "kv_cache_dtype": "fp8",
        "quantization": "fp8",
    }
    assert settings.to_dict()["engine"]["extra_args"]["enable_prefix_caching"] is False  # in the resume fingerprint
    with pytest.raises(ConfigError, match="max_num_seqs"):  # a typed field is still checked, whichever way it came
        load_settings(None, {"engine.max_num_seqs": 0})


def test_unknown_top_level_key_is_named(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'model = "m"\nmodle = "m"\n')
    with pytest.raises(ConfigError, match="modle"):
        load_settings(path)


def test_unknown_section_is_named(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[sampler]\nmax_tokens = 5\n")
    with pytest.raises(ConfigError, match="sampler"):
        load_settings(path)


def test_unknown_override_keys_are_named() -> None:
    with pytest.raises(ConfigError, match="max_tokenz"):
        load_settings(None, {"sampling.max_tokenz": 3})
    with pytest.raises(ConfigError, match="modle"):
        load_settings(None, {"modle": "x"})
    with pytest.raises(ConfigError, match="sampler"):
        load_settings(None, {"sampler.max_tokens": 3})


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "sampling = 5\n")
    with pytest.raises(ConfigError, match="sampling"):
        load_settings(path)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match="config file not found: ") as missing:
        load_settings(tmp_path / "absent.toml")
    assert missing.value.exit_code == 4  # a missing file is exit 4, whichever file it is
    bad = write_toml(tmp_path, "[sampling\nmax_tokens = 5\n")
    with pytest.raises(ConfigError, match=r"not valid TOML: .*\(at line 1, column 10\)"):
        load_settings(bad)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"sampling.max_tokens": 0}, "sampling.max_tokens"),
        ({"sampling.max_tokens": -5}, "sampling.max_tokens"),
        ({"sampling.max_tokens": 1.5}, "sampling.max_tokens"),
        ({"sampling.temperature": 2.5}, "sampling.temperature"),
        ({"sampling.temperature": -0.1}, "sampling.temperature"),
        ({"sampling.top_p": 0}, "sampling.top_p"),
        ({"sampling.top_p": 1.01}, "sampling.top_p"),
        ({"sampling.stop": [1, 2]}, "sampling.stop"),
        ({"engine.tensor_parallel_size": 0}, "engine.tensor_parallel_size"),
        ({"engine.data_parallel_size": 0}, "engine.data_parallel_size"),
        ({"engine.max_model_len": 0}, "engine.max_model_len"),
        ({"engine.max_num_seqs": 0}, "engine.max_num_seqs"),
        ({"engine.gpu_memory_utilization": 0}, "engine.gpu_memory_utilization"),
        ({"engine.gpu_memory_utilization": 1.5}, "engine.gpu_memory_utilization"),
        ({"plan.buckets": [32, 16]}, "plan.buckets"),
        ({"plan.buckets": [16, 16, 32]}, "plan.buckets"),
        ({"plan.buckets": [0, 16]}, "plan.buckets"),
        ({"plan.order": "random"}, "plan.order"),
        ({"plan.output_order": "sorted"}, "plan.output_order"),
        ({"plan.window_rows": 0}, "plan.window_rows"),
        ({"plan.max_in_flight": 0}, "plan.max_in_flight"),
        ({"plan.padding_batch_size": 0}, "plan.padding_batch_size"),
        # a value of the wrong type is a configuration error too, not a crash
        ({"plan.window_rows": "many"}, "plan.window_rows"),
        ({"plan.window_rows": 2.5}, "plan.window_rows"),
        ({"sampling.max_tokens": True}, "sampling.max_tokens"),
        ({"sampling.stop": ""}, "sampling.stop"),
        ({"plan.buckets": [16, "32"]}, "plan.buckets"),
        ({"engine.gpu_memory_utilization": "0.5"}, "engine.gpu_memory_utilization"),
        ({"engine.tensor_parallel_size": "2"}, "engine.tensor_parallel_size"),
        ({"sampling.seed": 1.5}, "sampling.seed"),
        ({"sampling.seed": 7.0}, "sampling.seed"),
        ({"sampling.seed": True}, "sampling.seed"),
        ({"sampling.seed": "7"}, "sampling.seed"),
        ({"sampling.seed": -1}, "sampling.seed"),  # vLLM would silently read -1 as "no seed"
        ({"sampling.seed": 2**63}, "sampling.seed"),
        ({"sampling.stop": [""]}, "sampling.stop"),
        ({"sampling.stop": ["###", ""]}, "sampling.stop"),
        ({"sampling.ignore_eos": "true"}, "sampling.ignore_eos"),
        ({"engine.seed": -1}, "engine.seed"),
        ({"engine.seed": 2**32}, "engine.seed"),
        ({"engine.seed": 0.5}, "engine.seed"),
        ({"engine.seed": False}, "engine.seed"),
        ({"engine.dtype": 16}, "engine.dtype"),
        ({"engine.dtype": ""}, "engine.dtype"),
        ({"engine.max_num_batched_tokens": 0}, "engine.max_num_batched_tokens"),
        ({"engine.max_num_batched_tokens": 512.0}, "engine.max_num_batched_tokens"),
        ({"engine.kv_cache_memory_bytes": 0}, "engine.kv_cache_memory_bytes"),
        ({"engine.kv_cache_memory_bytes": 1.5e9}, "engine.kv_cache_memory_bytes"),
        ({"engine.enforce_eager": "yes"}, "engine.enforce_eager"),
        ({"engine.enforce_eager": 1}, "engine.enforce_eager"),
        ({"engine.trust_remote_code": 1}, "engine.trust_remote_code"),
        ({"model": 5}, "model"),
    ],
)
def test_bad_ranges_raise_config_error(overrides: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")) as info:
        load_settings(None, overrides)
    [value] = overrides.values()
    assert str(info.value).startswith(f"{named} must be ")
    assert str(info.value).endswith(f", got {value!r}")  # the value given, as given


def test_bad_range_in_toml(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[sampling]\ntemperature = 9\n")
    with pytest.raises(ConfigError, match=r"sampling\.temperature"):
        load_settings(path)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[sampling]\nseed = 1.5\n", "sampling.seed must be an integer in [0, 2**63), got 1.5"),
        ("[sampling]\nseed = -3\n", "sampling.seed must be an integer in [0, 2**63), got -3"),
        ("[sampling]\nseed = true\n", "sampling.seed must be an integer in [0, 2**63), got True"),
        (
            '[sampling]\nstop = ["###", ""]\n',
            "sampling.stop must be a non-empty string or a list of non-empty strings, got ['###', '']",
        ),
        ("[engine]\nseed = 4294967296\n", "engine.seed must be an integer in [0, 2**32), got 4294967296"),
        (
            "[engine]\nkv_cache_memory_bytes = 0\n",
            "engine.kv_cache_memory_bytes must be an integer >= 1 (bytes), got 0",
        ),
        ("[engine]\nmax_num_batched_tokens = -1\n", "engine.max_num_batched_tokens must be an integer >= 1, got -1"),
        (
            "[sampling]\nn = 3\ntemperature = 0\n",
            "sampling.n must be 1 at temperature 0 (greedy sampling: vLLM refuses n > 1 with it), got 3",
        ),
    ],
)
def test_bad_values_in_toml_are_named_with_the_value(tmp_path: Path, toml: str, message: str) -> None:
    path = write_toml(tmp_path, toml)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    key, _, rest = message.partition(" must be ")
    assert str(info.value) == f"{key} in {path} must be {rest}"  # the key and the file it came from
    assert info.value.exit_code == EXIT_USAGE


def test_one_stop_string_is_a_list_of_one_as_in_a_row(tmp_path: Path) -> None:
    # [sampling] stop takes what a row's stop takes (one table: bulkinfer.fields.FIELDS)
    assert load_settings(write_toml(tmp_path, '[sampling]\nstop = "###"\n')).sampling.stop == ("###",)
    assert load_settings(None, {"sampling.stop": "END"}).sampling.stop == ("END",)


def test_long_values_are_cut_in_messages() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, {"sampling.stop": ["x" * 200, ""]})
    message = str(info.value)
    assert message.startswith("sampling.stop must be a non-empty string or a list of non-empty strings, got ['xxx")
    assert message.endswith("...") and len(message) < 160


def test_seed_boundaries_are_accepted() -> None:
    settings = load_settings(None, {"sampling.seed": 2**63 - 1, "engine.seed": 2**32 - 1})
    assert settings.sampling.seed == 2**63 - 1
    assert settings.engine.seed == 2**32 - 1
    settings = load_settings(None, {"sampling.seed": 0, "engine.seed": 0})
    assert (settings.sampling.seed, settings.engine.seed) == (0, 0)


def test_optional_engine_settings_accept_their_types() -> None:
    settings = load_settings(
        None,
        {
            "engine.max_num_batched_tokens": 1,
            "engine.kv_cache_memory_bytes": 2**32,
            "engine.enforce_eager": False,
            "engine.trust_remote_code": True,
            "engine.dtype": "bfloat16",
            "sampling.ignore_eos": True,
            "sampling.stop": ["\n"],
        },
    )
    assert settings.engine.max_num_batched_tokens == 1
    assert settings.engine.kv_cache_memory_bytes == 2**32
    assert settings.engine.enforce_eager is False
    assert settings.sampling.stop == ("\n",)


def test_config_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(InputFileError) as info:
        load_settings(tmp_path)
    assert str(info.value) == f"the config file {tmp_path} is a directory, not a file"
    assert info.value.exit_code == EXIT_INPUT


def test_a_config_that_is_a_fifo_is_refused_without_opening_it(tmp_path: Path) -> None:
    """Opening a FIFO would block until a writer comes: exit 4 at once."""
    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError) as info:
        load_settings(fifo)
    assert str(info.value) == f"the config file {fifo} is a named pipe (FIFO), not a file"


def test_unreadable_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toml(tmp_path, "[sampling]\nmax_tokens = 5\n")
    path.chmod(0)
    if os.geteuid() == 0:  # root reads through permission bits: refuse as the kernel would for others
        read_bytes = Path.read_bytes

        def denied(self: Path) -> bytes:
            if self == path:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return read_bytes(self)

        monkeypatch.setattr(Path, "read_bytes", denied)
    try:
        with pytest.raises(InputFileError) as info:
            load_settings(path)
    finally:
        path.chmod(0o644)
    assert str(info.value) == f"cannot read the config file {path}: Permission denied"
    assert info.value.exit_code == EXIT_INPUT


def test_other_os_errors_name_the_path_and_reason(tmp_path: Path) -> None:
    below_a_file = write_toml(tmp_path, "") / "settings.toml"
    with pytest.raises(InputFileError) as info:
        load_settings(below_a_file)
    assert str(info.value) == f"cannot read the config file {below_a_file}: Not a directory"

    loop = tmp_path / "loop.toml"
    loop.symlink_to(loop)
    with pytest.raises(InputFileError) as info:
        load_settings(loop)
    assert str(info.value) == f"cannot read the config file {loop}: Too many levels of symbolic links"


def test_boundary_values_are_accepted() -> None:
    settings = load_settings(
        None,
        {
            "sampling.max_tokens": 1,
            "sampling.temperature": 2,
            "sampling.top_p": 1,
            "engine.gpu_memory_utilization": 1.0,
            "plan.buckets": [1],
        },
    )
    assert settings.sampling.max_tokens == 1
    assert settings.sampling.temperature == 2
    assert settings.plan == PlanSettings(buckets=(1,))


def test_to_dict_is_json_ready() -> None:
    data = orjson.loads(orjson.dumps(load_settings(None, {"sampling.stop": ["a"], "model": "m"}).to_dict()))
    assert data["model"] == "m"
    assert data["sampling"]["stop"] == ["a"]
    assert data["plan"]["buckets"] == list(DEFAULT_BUCKETS)
    assert data["engine"]["dtype"] == "auto"
    assert data["engine"]["max_num_seqs"] is None


def test_default_toml_equals_builtin_defaults() -> None:
    path = REPO / "configs" / "default.toml"
    assert path.is_file(), path
    assert load_settings(path) == Settings()


class _Tokenizer:
    def __init__(self, chat_template: str | None):
        self.chat_template = chat_template


def test_apply_chat_template_is_auto_by_default_and_decided_by_the_tokenizer() -> None:
    settings = load_settings()
    assert settings.apply_chat_template == "auto"
    assert settings.resolve_chat_template(_Tokenizer("{{ messages }}")).apply_chat_template is True  # instruct
    assert settings.resolve_chat_template(_Tokenizer(None)).apply_chat_template is False  # a base model
    assert settings.resolve_chat_template(None).apply_chat_template is False  # no rows, no tokenizer
    forced = load_settings(None, {"apply_chat_template": False})
    assert forced.resolve_chat_template(_Tokenizer("{{ messages }}")).apply_chat_template is False
    with pytest.raises(ConfigError, match=r'apply_chat_template must be true, false or "auto", got \'yes\''):
        load_settings(None, {"apply_chat_template": "yes"})


def test_errors_name_the_flag_the_key_and_file_or_the_override(tmp_path: Path) -> None:
    origins = {"plan.order": "--order", "sampling.max_tokens": "--max-tokens"}
    with pytest.raises(ConfigError) as info:
        load_settings(None, {"plan.order": "random"}, origins)
    assert str(info.value) == "--order must be one of descending, ascending, arrival, got 'random'"
    with pytest.raises(ConfigError) as info:
        load_settings(None, {"sampling.max_tokens": 0}, origins)
    assert str(info.value) == "--max-tokens must be an integer >= 1, got 0"
    path = write_toml(tmp_path, '[plan]\norder = "random"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert str(info.value).startswith(f"plan.order in {path} must be one of ")
    # a flag given over a valid file value is named as the flag
    with pytest.raises(ConfigError, match=r"^--max-tokens must be"):
        load_settings(write_toml(tmp_path, "[sampling]\nmax_tokens = 5\n"), {"sampling.max_tokens": -1}, origins)


def test_default_toml_names_every_setting() -> None:
    """Every setting has a line in its table of configs/default.toml (set, or commented
    out where its default is unset and TOML has no null), so the file documents them all."""
    named: set[str] = set()
    table = ""
    for line in (REPO / "configs" / "default.toml").read_text(encoding="utf-8").splitlines():
        header = re.match(r"(?:# )?\[([a-z_.]+)\]$", line)
        key = re.match(r"(?:# )?([a-z_]+) = ", line)
        if header:
            table = header.group(1)
            named.add(table)
        elif key:
            named.add(f"{table}.{key.group(1)}" if table else key.group(1))
    for name, cls in (("sampling", SamplingDefaults), ("engine", EngineSettings), ("plan", PlanSettings)):
        for f in dataclasses.fields(cls):
            if f.name != "extra_args":  # any other [engine] key
                assert f"{name}.{f.name}" in named, f"{name}.{f.name} is not in default.toml"
    assert {"model", "passthrough", "apply_chat_template"} <= named
