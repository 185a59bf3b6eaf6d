"""The systems `bench.compare` measures, each run as its own subprocess on the same rows.

- ``a`` bulkinfer: the ``bulkinfer run`` CLI as a user runs it, ``--ignore-eos``,
  per-row ``max_tokens`` in the input, one ``--order``. Generation = its
  report's ``seconds.generate``.
- ``b`` raw vLLM: ``LLM.generate`` over all prompts at once in arrival order,
  as ``vllm bench throughput`` does (``bench.workers vllm-generate``).
  Generation = the ``generate`` call. The reference of every ratio.
- ``c`` vLLM run-batch: the rows as an OpenAI batch file through
  ``vllm.entrypoints.openai.run_batch`` (``bench.workers run-batch`` adds only
  two clocks around it).
- ``d`` transformers static batches of ``hf_batch_size``, in arrival order and
  length-bucketed, on a subset of the rows (``bench.workers hf-static``),
  compared with raw vLLM on the same subset (``b-subset``).
- ``e`` raw vLLM as ``b``, with vLLM's own defaults (its default dtype,
  compilation) but the KV cache size (see :class:`BenchSettings`).

End to end = the subprocess's wall time, start to exit (imports, model load,
generation, writing, shutdown). Every result counts tokens from what came back.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from bench.measure import Measured, run_measured, tail
from bench.workload import (
    PASSTHROUGH_CHAT_TEMPLATE,
    Row,
    write_bulkinfer_input,
    write_openai_batch,
    write_token_rows,
)

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "b"
# bulkinfer's prefix-aware feeding: its default (None), on, off
FEED_FLAGS = {None: "", True: " --prefix-aware", False: " --no-prefix-aware"}


class SystemFailed(RuntimeError):
    """A system's subprocess failed; the message holds the end of its log."""


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """What every system shares: the model, the vLLM engine arguments, sampling.

    ``defaults=False`` (fixed): every vLLM system gets :meth:`engine_args`
    (dtype, eager mode, KV cache size, seed). ``defaults=True``: each system
    runs with its own defaults: bulkinfer with only ``--seed`` (its measured
    dtype, eager mode, its KV cache share), raw vLLM (``b``) with the dtype
    bulkinfer ran, the seed and bulkinfer's KV cache size (both filled in
    from bulkinfer's report), and ``e`` with only the seed and that KV cache
    (vLLM's own default dtype and compilation). The KV cache: vLLM's CPU
    default reserves 92% of the memory (``gpu_memory_utilization``) and
    refuses to start when less is free, as on these 24 GiB machines."""

    model: str
    workdir: Path
    kv_cache_memory_bytes: int
    dtype: str = "float32"
    enforce_eager: bool = True
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    hf_batch_size: int = 16
    timeout_s: float | None = None
    defaults: bool = False
    # added to the environment of bulkinfer (a) and of the vLLM systems (b, c, e)
    bulkinfer_env: tuple[tuple[str, str], ...] = ()
    vllm_env: tuple[tuple[str, str], ...] = ()
    # added to bulkinfer's command line (a) after its engine flags, e.g. ("--speculative-tail", "16")
    bulkinfer_args: tuple[str, ...] = ()

    def engine_args(self) -> dict[str, Any]:
        """vLLM engine arguments of b and c (the rest are vLLM's defaults)."""
        if self.defaults:
            return {"dtype": self.dtype, "kv_cache_memory_bytes": self.kv_cache_memory_bytes, "seed": self.seed}
        return {
            "dtype": self.dtype,
            "enforce_eager": self.enforce_eager,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "seed": self.seed,
        }

    def engine_flags(self) -> list[str]:
        """:meth:`engine_args` as command-line flags; ``bulkinfer run`` and vLLM's
        run-batch spell them the same."""
        if self.defaults:
            return [
                "--dtype",
                self.dtype,
                "--kv-cache-memory-bytes",
                str(self.kv_cache_memory_bytes),
                "--seed",
                str(self.seed),
            ]
        return [
            "--dtype",
            self.dtype,
            "--enforce-eager" if self.enforce_eager else "--no-enforce-eager",
            "--kv-cache-memory-bytes",
            str(self.kv_cache_memory_bytes),
            "--seed",
            str(self.seed),
        ]

    def bulkinfer_flags(self) -> list[str]:
        """bulkinfer's engine flags: :meth:`engine_flags`, or with ``defaults``
        only the seed; then ``bulkinfer_args``."""
        return [*(["--seed", str(self.seed)] if self.defaults else self.engine_flags()), *self.bulkinfer_args]

    def env(self, extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
        return {
            **os.environ,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            **dict(extra),
        }


def rates(rows: int, prompt_tokens: int, completion_tokens: int, seconds: float | None) -> dict[str, float] | None:
    """Requests/s, completion tokens/s and total (prompt + completion) tokens/s."""
    if not seconds:
        return None
    return {
        "requests_per_s": rows / seconds,
        "completion_tokens_per_s": completion_tokens / seconds,
        "total_tokens_per_s": (prompt_tokens + completion_tokens) / seconds,
    }


def result(
    key: str,
    system: str,
    counts: dict[str, Any],
    generate_s: float,
    measured: Measured | None,
    cmd: Sequence[str],
    rows_expected: Sequence[Row],
    *,
    reference: str = REFERENCE,
    load_s: float | None = None,
    padding: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One system's record. ``counts``: ``rows``, ``prompt_tokens``,
    ``completion_tokens`` (what came back), ``rows_full_length`` and, where
    the system tells, ``cached_tokens`` (prompt tokens vLLM's prefix cache
    served: ``prefix_cache``)."""
    wall = measured.wall_s if measured else None
    rows, prompt, completion = counts["rows"], counts["prompt_tokens"], counts["completion_tokens"]
    cached = counts.get("cached_tokens")
    return {
        "key": key,
        "system": system,
        "reference": reference,
        "rows": rows,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "expected": {
            "rows": len(rows_expected),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in rows_expected),
            "completion_tokens": sum(r.max_tokens for r in rows_expected),
        },
        "rows_full_length": counts.get("rows_full_length"),
        "prefix_cache": None if cached is None else {"cached_tokens": cached, "hit_rate": cached / max(prompt, 1)},
        "seconds": {"load": load_s, "generate": generate_s, "end_to_end": wall},
        "throughput_generate": rates(rows, prompt, completion, generate_s),
        "throughput_end_to_end": rates(rows, prompt, completion, wall),
        "peak_rss_bytes": measured.peak_rss_bytes if measured else None,
        "peak_rss_largest_process_bytes": measured.peak_rss_largest_process_bytes if measured else None,
        "cpu_s": measured.cpu_s if measured else None,
        "loadavg_before": list(measured.loadavg_before) if measured else None,
        "padding_efficiency": padding,
        "command": list(cmd),
        **(extra or {}),
    }


def _run(cmd: list[str], key: str, settings: BenchSettings, extra_env: tuple[tuple[str, str], ...] = ()) -> Measured:
    log = settings.workdir / f"{key}.log"
    shown = " ".join(f"{k}={v}" for k, v in extra_env)
    print(f"[bench] {key}: {shown + ' ' if shown else ''}{' '.join(cmd)}", file=sys.stderr, flush=True)
    measured = run_measured(cmd, log, env=settings.env(extra_env), cwd=ROOT, timeout=settings.timeout_s)
    if measured.returncode != 0:
        raise SystemFailed(f"{key} exited with {measured.returncode}; end of {log}:\n{tail(log)}")
    print(f"[bench] {key}: {measured.wall_s:.1f} s", file=sys.stderr, flush=True)
    return measured


def _bulkinfer_exe() -> list[str]:
    script = Path(sys.executable).parent / "bulkinfer"
    found = script if script.exists() else shutil.which("bulkinfer")
    return [str(found)] if found else [sys.executable, "-m", "bulkinfer"]


def run_bulkinfer(
    rows: Sequence[Row],
    order: str,
    settings: BenchSettings,
    key: str | None = None,
    prefix_aware: bool | None = None,
    reference: str = REFERENCE,
) -> dict[str, Any]:
    """(a) ``bulkinfer run`` with ``--order`` and, unless None (bulkinfer's
    default), ``--prefix-aware`` or ``--no-prefix-aware``; generation from its report.
    ``key`` names the result and its files (default ``a-<order>``; repeats add a suffix)."""
    key = key or f"a-{order}"
    src = settings.workdir / "bulkinfer.jsonl"
    write_bulkinfer_input(rows, src)
    out = settings.workdir / f"{key}.out.jsonl"
    cmd = [
        *_bulkinfer_exe(),
        "run",
        str(src),
        "-o",
        str(out),
        "--overwrite",
        "--plain-progress",
        "--raw-prompts",  # the workload's prompt tokens, as every other system gets them
        "--model",
        settings.model,
        "--ignore-eos",
        "--temperature",
        str(settings.temperature),
        "--top-p",
        str(settings.top_p),
        "--order",
        order,
        *FEED_FLAGS[prefix_aware].split(),
        *settings.bulkinfer_flags(),
    ]
    measured = _run(cmd, key, settings, settings.bulkinfer_env)
    report = orjson.loads(out.with_name(out.name.removesuffix(".jsonl") + ".report.json").read_bytes())
    wanted = {r.id: r.max_tokens for r in rows}
    outputs = [orjson.loads(line) for line in out.read_bytes().splitlines() if line.strip()]
    counts = {
        "rows": report["request_counts"]["completed"],
        "prompt_tokens": report["tokens"]["prompt"],
        "completion_tokens": report["tokens"]["completion"],
        "rows_full_length": sum(o["completion_tokens"] == wanted.get(o["id"]) for o in outputs),
        "cached_tokens": (report.get("prefix_cache") or {}).get("cached_tokens"),
    }
    pad = report["padding_efficiency"]
    feed = order + ("+prefix" if report["plan"].get("prefix_aware") else "")
    return result(
        key,
        f"bulkinfer run --order {order}" + FEED_FLAGS[prefix_aware],
        counts,
        report["seconds"]["generate"],
        measured,
        cmd,
        rows,
        reference=reference,
        load_s=report["seconds"]["load"],
        padding={"arrival": pad["arrival"], "sorted": pad["sorted"], "batch_size": pad["batch_size"], "static": False},
        extra={
            "order": order,
            "feed": feed,
            "bulkinfer_seconds": report["seconds"],
            "bulkinfer_cpu_seconds": report.get("cpu_seconds"),
            "engine": report.get("engine"),
        },
    )


def run_vllm_generate(
    rows: Sequence[Row],
    settings: BenchSettings,
    subset: Sequence[Row] = (),
    key: str = "b",
    engine_args: dict[str, Any] | None = None,
    reference: str = REFERENCE,
) -> list[dict[str, Any]]:
    """(b) raw ``LLM.generate`` on ``rows`` with ``engine_args`` (default
    :meth:`BenchSettings.engine_args`); then, when ``subset`` (the static
    baseline's rows) is given and is not all of them, (b-subset) those rows
    alone. ``key`` names the result and its files (``e``: vLLM's defaults)."""
    src = settings.workdir / "rows.jsonl"
    write_token_rows(rows, src)
    out = settings.workdir / f"{key}.result.json"
    subset_src = settings.workdir / "subset_rows.jsonl"
    with_subset = 0 < len(subset) < len(rows)
    if with_subset:
        write_token_rows(subset, subset_src)
    cmd = [
        sys.executable,
        "-m",
        "bench.workers",
        "vllm-generate",
        "--rows",
        str(src),
        "--out",
        str(out),
        "--model",
        settings.model,
        "--engine-args",
        json.dumps(settings.engine_args() if engine_args is None else engine_args),
        "--temperature",
        str(settings.temperature),
        "--top-p",
        str(settings.top_p),
        *(["--subset-rows", str(subset_src)] if with_subset else []),
    ]
    measured = _run(cmd, key, settings, settings.vllm_env)
    res = json.loads(out.read_text())
    # b's end to end is its process without the b-subset rerun that follows b's own generate call.
    subset_s = res["subset"]["generate_s"] if "subset" in res else 0.0
    results = [
        result(
            key,
            "vLLM LLM.generate, all at once, arrival order" + ("" if engine_args is None else ", vLLM's defaults"),
            res["all"],
            res["all"]["generate_s"],
            replace(measured, wall_s=measured.wall_s - subset_s),
            cmd,
            rows,
            reference=reference,
            load_s=res["load_s"],
            extra={
                "process_wall_s": measured.wall_s,
                "end_to_end_excludes_subset_s": subset_s,
                "engine": res.get("engine"),
                "cpu_threads": res["all"].get("cpu_threads"),
            },
        )
    ]
    if "subset" in res:
        results.append(
            result(
                "b-subset",
                f"vLLM LLM.generate, the static baseline's {len(subset)} rows (same process, after b)",
                res["subset"],
                res["subset"]["generate_s"],
                None,
                cmd,
                subset,
                reference="b-subset",
            )
        )
    return results


def run_vllm_run_batch(rows: Sequence[Row], settings: BenchSettings) -> dict[str, Any]:
    """(c) ``vllm run-batch`` on the rows as an OpenAI batch file."""
    src = settings.workdir / "batch.jsonl"
    write_openai_batch(rows, src, settings.model, settings.temperature, settings.top_p)
    template = settings.workdir / "passthrough.jinja"
    template.write_text(PASSTHROUGH_CHAT_TEMPLATE)
    out = settings.workdir / "c.out.jsonl"
    timing = settings.workdir / "c.timing.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.workers",
        "run-batch",
        "--timing",
        str(timing),
        "--",
        "-i",
        str(src),
        "-o",
        str(out),
        "--model",
        settings.model,
        *settings.engine_flags(),
        "--chat-template",
        str(template),
        "--chat-template-content-format",
        "string",
        # Sampling defaults from the request and vLLM, not the model's generation_config.json,
        # as for LLM.generate with explicit SamplingParams.
        "--generation-config",
        "vllm",
        "--disable-log-stats",
    ]
    measured = _run(cmd, "c", settings, settings.vllm_env)
    wanted = {r.id: (len(r.prompt_token_ids), r.max_tokens) for r in rows}
    ok = prompt = completion = full = prompt_mismatch = 0
    errors: list[str] = []
    for line in out.read_bytes().splitlines():
        if not line.strip():
            continue
        rec = orjson.loads(line)
        response = rec.get("response") or {}
        if rec.get("error") or response.get("status_code") != 200:
            errors.append(f"{rec.get('custom_id')}: {rec.get('error')}")
            continue
        usage = response["body"]["usage"]
        want_prompt, want_completion = wanted[rec["custom_id"]]
        ok += 1
        prompt += usage["prompt_tokens"]
        completion += usage["completion_tokens"]
        full += usage["completion_tokens"] == want_completion
        prompt_mismatch += usage["prompt_tokens"] != want_prompt
    if errors:
        raise SystemFailed(f"c: {len(errors)} requests failed, e.g. {errors[:3]}")
    counts = {"rows": ok, "prompt_tokens": prompt, "completion_tokens": completion, "rows_full_length": full}
    clocks = json.loads(timing.read_text())
    return result(
        "c",
        "vllm run-batch (OpenAI batch file)",
        counts,
        clocks["generate_s"],
        measured,
        cmd,
        rows,
        load_s=clocks["load_s"],
        extra={"rows_prompt_tokens_mismatch": prompt_mismatch},
    )


def run_hf_static(rows: Sequence[Row], subset: Sequence[Row], order: str, settings: BenchSettings) -> dict[str, Any]:
    """(d) transformers ``generate``, static batches, on ``subset`` (of ``rows``)."""
    key = f"d-{order}"
    src = settings.workdir / "hf_rows.jsonl"
    write_token_rows(subset, src)
    out = settings.workdir / f"{key}.result.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.workers",
        "hf-static",
        "--rows",
        str(src),
        "--out",
        str(out),
        "--model",
        settings.model,
        "--order",
        order,
        "--batch-size",
        str(settings.hf_batch_size),
        "--dtype",
        settings.dtype,
        "--temperature",
        str(settings.temperature),
        "--top-p",
        str(settings.top_p),
        "--seed",
        str(settings.seed),
    ]
    measured = _run(cmd, key, settings)
    res = json.loads(out.read_text())
    same_rows = len(subset) == len(rows)
    return result(
        key,
        f"transformers generate, static B={settings.hf_batch_size}, {order}"
        + ("" if same_rows else f", {len(subset)} rows"),
        res["all"],
        res["all"]["generate_s"],
        measured,
        cmd,
        subset,
        reference=REFERENCE if same_rows else "b-subset",
        load_s=res["load_s"],
        padding={**res["padding_efficiency"], "batch_size": settings.hf_batch_size, "static": True},
        extra={
            "generated_tokens": res["all"]["generated_tokens"],
            "rows_prompt_tokens_mismatch": res["all"]["rows_prompt_tokens_mismatch"],
            "torch_threads": res["torch_threads"],
        },
    )
