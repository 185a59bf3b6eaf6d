"""A stand-in for the default model in orchestration tests: a prepared-model
directory whose tokenizer is a real Hugging Face fast tokenizer (word-level,
built here, nothing downloaded) with a chat template, and whose weights file
is an empty placeholder. The fake engine never reads weights; anything that
needs the real model is an ``e2e`` test."""

from __future__ import annotations

import json
from pathlib import Path

from bulkinfer.default_model import _write_marker  # the marker a real preparation writes

SPECIAL = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
WORDS = "the a of to and is in what capital france germany japan word hi hello count ten prompt".split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build(home: Path, name: str = "smollm2-135m-instruct") -> Path:
    """``home/models/NAME``, prepared: config.json, tokenizer, empty weights, marker."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model_dir = home / "models" / name
    model_dir.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate([*SPECIAL, *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 2048}
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "model.safetensors").write_bytes(b"")
    source = model_dir / "tiny.gguf"  # the marker names a source file; this one is a placeholder
    source.write_bytes(b"")
    _write_marker(model_dir, name=name, source=source)
    source.unlink()
    return model_dir
