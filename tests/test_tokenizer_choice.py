"""bulkinfer.tokenizer_choice: AutoTokenizer's choice of class remembered per
local model directory, and chosen again when what it depends on changes.
(The real default model's tokenizer, loaded both ways, is compared in
tests/test_models.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import transformers

from bulkinfer.models import load_tokenizer, resolve_model
from bulkinfer.tokenizer_choice import CHOICES_FILE, choice_key, remember_class, remembered_class


@pytest.fixture
def model(tmp_path: Path) -> str:
    """A copy of the tiny default model's directory (this test may change it)."""
    copy = tmp_path / "model"
    shutil.copytree(resolve_model(None), copy)
    return str(copy)


@pytest.fixture
def auto_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The models AutoTokenizer.from_pretrained is asked for, in order."""
    asked: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained

    def counted(name: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(str(name))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    return asked


def test_the_second_load_skips_autotokenizer_and_tokenizes_the_same(model: str, auto_loads: list[str]) -> None:
    first = load_tokenizer(model)
    second = load_tokenizer(model)
    assert auto_loads == [model]
    assert type(second) is type(first)
    text = "what is the capital of france"
    assert second(text)["input_ids"] == first(text)["input_ids"] != []
    messages = [{"role": "user", "content": "hello"}]
    assert second.apply_chat_template(messages, tokenize=False) == first.apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize("change", ["tokenizer_config.json", "config.json", "a new file"])
def test_a_changed_directory_is_chosen_again(model: str, auto_loads: list[str], change: str) -> None:
    load_tokenizer(model)
    if change == "a new file":
        (Path(model) / "tokenizer.model").write_bytes(b"")  # a sentencepiece file beside the configs
    else:
        config = Path(model) / change
        config.write_text(json.dumps({**json.loads(config.read_text()), "note": "changed"}))
    load_tokenizer(model)
    load_tokenizer(model)
    assert auto_loads == [model, model]  # chosen again once, then remembered under the new key


def test_another_transformers_version_or_trust_remote_code_is_another_key(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = choice_key(model, False)
    assert key is not None and choice_key(model, True) != key
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.0.1")
    assert choice_key(model, False) != key


def test_a_hub_id_and_a_class_outside_transformers_are_not_remembered(model: str, tiny_home: Path) -> None:
    assert choice_key("org/name", False) is None
    before = (tiny_home / CHOICES_FILE).read_bytes() if (tiny_home / CHOICES_FILE).exists() else None

    class RemoteCode:  # a tokenizer class from the model's own code (trust_remote_code)
        pass

    remember_class(model, choice_key(model, True), RemoteCode)
    after = (tiny_home / CHOICES_FILE).read_bytes() if (tiny_home / CHOICES_FILE).exists() else None
    assert after == before
    assert remembered_class(model, choice_key(model, True)) is None


@pytest.mark.parametrize("stored", [b"{torn", b"[]", b'{"MODEL": {"key": "KEY", "module": "nowhere", "class": "X"}}'])
def test_an_unreadable_or_unimportable_record_is_chosen_again(
    model: str, tiny_home: Path, auto_loads: list[str], stored: bytes
) -> None:
    key = choice_key(model, False)
    assert key is not None
    record = stored.replace(b"MODEL", str(Path(model).resolve()).encode()).replace(b"KEY", key.encode())
    (tiny_home / CHOICES_FILE).write_bytes(record)
    assert load_tokenizer(model)("hello")["input_ids"]
    assert auto_loads == [model]
    assert json.loads((tiny_home / CHOICES_FILE).read_text())[str(Path(model).resolve())]["key"] == key
