"""The settings of a run as frozen dataclasses, one per TOML table
(``[sampling]``, ``[engine]``, ``[plan]``, ``[ray]``) and :class:`Settings`
holding them. Built and validated by :func:`bulkinfer.config.load_settings`
(which re-exports these names); checked by :func:`bulkinfer.checks.validate`.
Importing this module imports nothing of bulkinfer's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

FeedOrder = Literal["descending", "ascending", "arrival"]
OutputOrder = Literal["input", "completion"]

# Upper bounds (inclusive, prompt tokens) of the default buckets; a last
# bucket takes everything longer than the last bound.
DEFAULT_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Per-request sampling defaults; a row's own fields override them.

    Names and meanings follow the OpenAI API and vLLM's ``SamplingParams``.
    ``max_tokens`` counts completion tokens.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: Mapping[str, float] | None = None
    # log-probabilities: None = none; k = each completion token's with the top k alternatives
    logprobs: int | None = None
    # lower runs first (vLLM's priority scheduling; any row with a priority turns it on)
    priority: int = 0
    # a vLLM StructuredOutputsParams table: one of json, regex, choice, grammar, json_object
    structured_outputs: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """vLLM engine arguments, with vLLM's names. ``None`` means "let bulkinfer
    choose for this device" (see :func:`bulkinfer.engine.args.resolve_engine_args`).

    The common arguments are typed fields (checked here); ``extra_args``
    holds any other field of vLLM's ``EngineArgs`` (``enable_prefix_caching``,
    ``quantization``, ``kv_cache_dtype``, ...): any other key of the
    ``[engine]`` table or ``--engine-arg KEY=VALUE``, checked against
    ``EngineArgs`` itself where the engine is built.

    ``top_p_sampler`` is bulkinfer's, not vLLM's: ``"auto"`` applies a
    request's ``top_p`` on CPU with bulkinfer's nucleus processor
    (:mod:`bulkinfer.engine.nucleus`: the same tokens kept, without sorting
    the vocabulary), ``"vllm"`` with vLLM's own sort.

    ``batch_order`` is bulkinfer's too: ``"auto"`` keeps the engine's running
    batch in KV-block order on CPU, so rows sharing a prompt prefix are
    decoded next to each other (:mod:`bulkinfer.engine.batch_order`);
    ``"vllm"`` leaves vLLM's own order.

    ``speculative_tail`` (rows; bulkinfer's, 0: off) turns on vLLM's
    speculative decoding by n-gram prompt lookup only in engine steps of at
    most that many running rows, a job's tail (vLLM's
    ``speculative_config``: :func:`bulkinfer.engine.args.tail_speculation`).

    ``huge_pages_at_start`` is bulkinfer's: False starts the engine with
    transparent huge pages paused, so its KV cache is faulted in 4 KiB
    pages (a faster start on a VM that hands free memory back to its host,
    slower steps after; an engine in vLLM's child processes keeps the pause
    for its life); True keeps them; None lets a run decide by its job
    (:func:`bulkinfer.jobs.engine_choice.choose_huge_pages`) and keeps them
    elsewhere (:func:`bulkinfer.engine.malloc.huge_pages_paused`).
    """

    dtype: str = "auto"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool | None = None
    seed: int = 0
    trust_remote_code: bool = False
    top_p_sampler: str = "auto"
    batch_order: str = "auto"
    speculative_tail: int = 0
    huge_pages_at_start: bool | None = None
    extra_args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """How prompts are sorted, bucketed and fed to the engine.

    - ``buckets``: inclusive upper bounds in prompt tokens, ascending.
    - ``order``: the order buckets are fed in; ``descending`` (longest first)
      by default: the three orders measured level on ShareGPT-200 on CPU
      (docs/performance.md, Feed order), and longest-first shortens the tail
      when the queue is deeper than the engine's running batch.
    - ``prefix_aware``: within a window, rows whose prompts share at least
      one KV-cache block of tokens are fed together, the longest first, so
      the others hit vLLM's prefix cache (:mod:`bulkinfer.prep.prefix`);
      groups are ordered by ``order``. Measured in docs/performance.md, Prefix-aware feeding.
    - ``window_rows``: rows read, tokenized and sorted together; memory is
      bounded by about two windows whatever the file size.
    - ``max_in_flight``: requests handed to the engine and not yet finished;
      ``None`` means 2 x the engine's ``max_num_seqs``.
    - ``padding_batch_size``: the static batch size B used only to *report*
      padding efficiency (vLLM itself does not pad).
    - ``stall_timeout_s``: seconds one engine step may take before the engine
      counts as stuck (exit 5, finished rows kept). A dead engine process is
      noticed within 0.2 s whatever this is; this catches an engine that is
      alive but no longer answers. One step is at most one batch of
      ``max_num_batched_tokens`` prompt tokens: raise it for large models on
      CPU. ``None``: wait for ever.
    - ``start_timeout_s``: seconds a run's model load and engine start (the
      tokenizer, a dtype probe or compiled start it chooses, the engine) may
      take before the run counts as stuck: the CLI then kills the engine's
      processes and exits 5 (no row was run yet; the lock is freed). vLLM's
      own ``VLLM_ENGINE_READY_TIMEOUT_S`` (600 s) bounds only an engine in
      child processes; one CPU engine starts in bulkinfer's process, where
      nothing else would. ``None``: wait for ever.
    - ``max_wait_s``: a stream's rows (``bulkinfer run -``) go to the
      planner when ``window_rows`` of them arrived or the oldest of them has
      waited this many seconds: longer fills fuller, better-sorted windows,
      shorter answers sooner. A file's rows never wait (they are read as
      fast as the engine takes them). The default, 1 s, by measurement
      (README, "Streams": within 0.4-0.6 s of 0.1 s at the median below
      capacity, 5 s adds 3.5-4 s; over capacity windows fill whatever the wait).
    - ``output_order``: the order of the rows in the output and errors files:
      ``input`` (the input's, restored at publishing by an external merge in
      bounded memory, see :mod:`bulkinfer.io.spool`) or ``completion`` (the
      order rows finished in, published in one streaming pass without a sort).
      None (unset): ``input`` for a file, ``completion`` for a stream
      (``bulkinfer run -``, whose input order holds finished rows in a bounded
      reorder buffer: :mod:`bulkinfer.io.stream_out`).
    """

    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    order: FeedOrder = "descending"
    prefix_aware: bool = True
    window_rows: int = 8192
    max_in_flight: int | None = None
    padding_batch_size: int = 16
    stall_timeout_s: float | None = 600.0
    start_timeout_s: float | None = 1800.0
    output_order: OutputOrder | None = None
    max_wait_s: float = 1.0

    @property
    def file_output_order(self) -> OutputOrder:
        """The output order of a file's run: ``output_order``, ``input`` when unset."""
        return self.output_order or "input"


@dataclass(frozen=True, slots=True)
class RaySettings:
    """Where the replicas run when a Ray cluster runs them (``--ray``); they
    do not shape results, so a resumed run may change them.

    - ``address``: None (no Ray: replicas on this host), ``"local"`` (start a
      Ray cluster on this machine for the run), ``"auto"`` (the cluster this
      machine is part of), ``"ray://HOST:PORT"`` (Ray Client) or a GCS
      ``HOST:PORT``; what ``ray.init(address=...)`` takes.
    - ``cpus_per_replica``: Ray CPUs each replica's actor reserves on a
      cluster without GPUs (its engine's threads); None: the cluster's CPUs
      divided among the replicas, at most one node's.
    - ``max_restarts``: how often Ray restarts a replica's actor that died
      (Ray's ``max_restarts``; -1: without limit). Its unfinished requests go
      to the other replicas at once, and it rejoins once restarted.
    """

    address: str | None = None
    cpus_per_replica: int | None = None
    max_restarts: int = 3


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything one ``bulkinfer run`` needs besides its input and output paths."""

    model: str | None = None
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    engine: EngineSettings = field(default_factory=EngineSettings)
    plan: PlanSettings = field(default_factory=PlanSettings)
    ray: RaySettings = field(default_factory=RaySettings)
    passthrough: bool = True
    # Send each ``prompt`` as a one-message user chat through the model's chat
    # template (what instruct models expect): True, False, or "auto" = when the
    # tokenizer has a chat template (see resolve_chat_template). ``messages``
    # rows and OpenAI /v1/chat/completions lines always are; /v1/completions
    # lines never.
    apply_chat_template: bool | Literal["auto"] = "auto"
    # Variables for the chat template of every chat row (vLLM serve's
    # --default-chat-template-kwargs), under a row's own chat_template_kwargs
    # and fields (bulkinfer.prep.chat_template): e.g. {"enable_thinking": False}.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def resolve_chat_template(self, tokenizer: Any) -> Settings:
        """These settings with ``apply_chat_template`` decided: ``"auto"``
        becomes True when ``tokenizer`` has a chat template (an instruct
        model), False when it has none or is None (a base model)."""
        if isinstance(self.apply_chat_template, bool):
            return self
        return dataclasses.replace(self, apply_chat_template=bool(getattr(tokenizer, "chat_template", None)))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (tuples become lists)."""
        return dataclasses.asdict(self)
