"""The engine's running batch kept in KV-block order, so that rows sharing a
prompt prefix sit next to each other in every step (CPU).

A decode step on CPU reads every running row's whole KV cache: with
hundreds of rows over long contexts that is gigabytes a step, and the
attention kernel waits on memory. Rows whose prompts share a prefix share
its KV blocks (vLLM's prefix cache gives them the same physical blocks), so
a shared block read for one row is still in the core's caches when the next
row reads it, if that row comes next. vLLM's persistent batch
(``InputBatch``) admits requests into the lowest free slots and, as rows
finish, moves the last rows into the holes (``InputBatch.condense``): the
order drifts away from the order bulkinfer fed the siblings in. After
vLLM's own reordering each step (``GPUModelRunner._may_reorder_batch``, the
hook vLLM's attention backends use to reorder the batch), :func:`order_by_blocks`
sorts the running rows by their block tables (the first
:data:`BLOCK_COLUMNS` block ids, lexicographically), swapping rows with
vLLM's ``InputBatch.swap_states``, which also tells logits processors of the
moves. Only when at least two running rows share their first block: a
batch of rows that share nothing is left as vLLM ordered it.

Measured with ``python -m bench.batch_order`` (README, Engine settings).

Installed on each of the engine's workers by name with vLLM's
``collective_rpc``, in bulkinfer's process or in engine core processes of
their own (replicas): the worker class gains :class:`BatchOrderExtension`
through vLLM's ``EngineArgs.worker_extension_cls`` (:func:`hooked`), since
vLLM sends ``collective_rpc`` a function, rather than a method name, to
another process only under ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. vLLM
leaves ``worker_extension_cls`` out of its config hash (``ParallelConfig.compute_hash``),
so compiled engines share their compile cache with or without it. Only
where vLLM's attention backend does not reorder the batch itself (its
``reorder_batch_threshold`` is unset: the CPU backend).

The same step hook counts vLLM's **preemptions**: the running requests its
scheduler stopped to free KV blocks for others (their blocks freed, their
tokens computed again when they resume), which vLLM names in the
``SchedulerOutput.preempted_req_ids`` of the step that preempted them
(``Scheduler._preempt_request``, vllm 0.32) whether or not it logs stats
(vLLM's own counters, ``IterationStats.num_preempted_reqs``, need
``log_stats``, which bulkinfer's engine runs without). The hook is on every
CPU engine that generates (:func:`hooked`), sorting or not (:func:`wanted`).
With speculative decoding on, it also counts the **draft tokens** each step
checks (``SchedulerOutput.scheduled_spec_decode_tokens``) and the ones the
model **accepted**: a request's tokens in a step's
``ModelRunnerOutput.sampled_token_ids`` beyond its first (vLLM's own
reading, ``num_accepted_tokens = len(generated_token_ids) - 1`` in
``Scheduler.update_from_output``), from the model runner's
``sample_tokens``, wrapped. vLLM's own counts
(``SpecDecodingStats.num_draft_tokens``, ``num_accepted_tokens``) need
``log_stats`` too. The hook also counts the ranks of logprobs eagerly
(:mod:`bulkinfer.engine.logprob_ranks`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from bulkinfer.engine import logprob_ranks

# Block ids compared per row: siblings that share more blocks sit closer.
BLOCK_COLUMNS = 8

# vLLM's ``EngineArgs.worker_extension_cls`` value that gives its workers :class:`BatchOrderExtension`.
EXTENSION = f"{__name__}.BatchOrderExtension"


def hooked(device: str, args: Mapping[str, Any]) -> bool:
    """Whether an engine started with vLLM engine arguments ``args`` on
    ``device`` gets bulkinfer's step hook (CPU, a generating runner, no
    ``worker_extension_cls`` of the user's): then it is started with
    ``worker_extension_cls`` :data:`EXTENSION`."""
    return device == "cpu" and args.get("runner") != "pooling" and not args.get("worker_extension_cls")


def wanted(setting: str, args: Mapping[str, Any]) -> bool:
    """Whether a :func:`hooked` engine's running batch is kept in KV-block
    order: ``[engine] batch_order`` ``setting`` ``"auto"`` and the prefix
    cache not turned off in ``args``."""
    return setting == "auto" and args.get("enable_prefix_caching") is not False


def order_by_blocks(batch: Any) -> int:
    """Sorts vLLM's ``InputBatch`` ``batch`` (its first ``num_reqs`` rows) by
    the rows' first :data:`BLOCK_COLUMNS` KV block ids (group 0's block
    table), lexicographically, with ``batch.swap_states``; returns the swaps
    made. No-op (0) when no two rows share their first block."""
    import numpy as np

    rows = batch.num_reqs
    if rows < 2:
        return 0
    table = batch.block_table.block_tables[0].block_table.np
    keys = table[:rows, : min(BLOCK_COLUMNS, table.shape[1])]
    if len(np.unique(keys[:, 0])) == rows:
        return 0
    order = np.lexsort(keys[:, ::-1].T)  # lexsort's last key is its primary: block 0 first
    if (order == np.arange(rows)).all():
        return 0
    wanted = [batch.req_ids[i] for i in order]
    swaps = 0
    for position, request_id in enumerate(wanted):
        current = batch.req_id_to_index[request_id]
        if current != position:
            batch.swap_states(position, current)
            swaps += 1
    return swaps


def install(worker: Any, sort: bool = True) -> bool:
    """Run by vLLM's ``collective_rpc`` on each worker: after vLLM's own
    reordering in every step, count the step's preemptions and draft tokens
    and, with ``sort``, :func:`order_by_blocks`; and rank logprobs eagerly
    (:func:`bulkinfer.engine.logprob_ranks.install`). Returns False (nothing
    installed) where the model runner has no such hook or its attention
    backend reorders the batch itself."""
    runner: Any = getattr(worker, "model_runner", None)
    vllm_reorder = getattr(runner, "_may_reorder_batch", None)
    if vllm_reorder is None or getattr(runner, "reorder_batch_threshold", None) is not None:
        return False
    tally = {"steps": 0, "swaps": 0, "seconds": 0.0, "preemptions": 0, "draft_tokens": 0, "accepted_tokens": 0}

    def reorder(scheduler_output: Any) -> None:
        vllm_reorder(scheduler_output)
        tally["steps"] += 1
        tally["preemptions"] += len(getattr(scheduler_output, "preempted_req_ids", None) or ())
        drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
        if drafts:
            tally["draft_tokens"] += sum(map(len, drafts.values()))
        if sort:
            start = time.perf_counter()
            tally["swaps"] += order_by_blocks(runner.input_batch)
            tally["seconds"] += time.perf_counter() - start

    runner._may_reorder_batch = reorder
    vllm_sample = getattr(runner, "sample_tokens", None)
    if getattr(runner, "speculative_config", None) is not None and vllm_sample is not None:

        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            out = vllm_sample(*args, **kwargs)
            sampled = getattr(out, "sampled_token_ids", None)  # a request's tokens this step: 1 + drafts accepted
            if isinstance(sampled, list):
                tally["accepted_tokens"] += sum(len(tokens) - 1 for tokens in sampled if len(tokens) > 1)
            return out

        runner.sample_tokens = sample_tokens
    runner.bulkinfer_batch_order = tally
    logprob_ranks.install()  # in this worker's process: no compilation at the first logprobs step
    return True


def tally(worker: Any) -> dict[str, float] | None:
    """Run by ``collective_rpc``: the worker's steps, preemptions, draft
    tokens, swaps and seconds spent sorting since :func:`install` (None where it is not
    installed). Every worker of an engine runs the same steps, so any one's
    counts are the engine's."""
    found = getattr(getattr(worker, "model_runner", None), "bulkinfer_batch_order", None)
    return None if found is None else dict(found)


def install_all(engine: Any, sort: bool) -> bool:
    """Runs :func:`install` (``sort``) on every worker of vLLM's ``LLMEngine``
    ``engine``, started with :data:`EXTENSION`, by ``collective_rpc``; True
    when every worker took it."""
    installed = engine.collective_rpc("bulkinfer_batch_order_install", args=(sort,))
    return bool(installed) and all(installed)


def step_counts(engine: Any, sorting: bool, speculating: bool = False) -> dict[str, int]:
    """Since :func:`install_all` on ``engine``: ``preemptions``, the requests
    vLLM's scheduler preempted; when ``sorting`` (the KV-block order is on)
    ``batch_order_swaps``, the rows moved into it; when ``speculating``
    (speculative decoding is on) ``spec_decode_draft_tokens``, the draft
    tokens its steps checked, and ``spec_decode_accepted_tokens``, those the
    model accepted. The first worker's counts: every worker of an engine
    runs the same steps."""
    counted = engine.collective_rpc("bulkinfer_batch_order_tally")[0]
    swaps = {"batch_order_swaps": int(counted["swaps"])} if sorting else {}
    drafts = (
        {
            "spec_decode_draft_tokens": int(counted.get("draft_tokens", 0)),
            "spec_decode_accepted_tokens": int(counted.get("accepted_tokens", 0)),
        }
        if speculating
        else {}
    )
    return {"preemptions": int(counted["preemptions"]), **swaps, **drafts}


class BatchOrderExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``
    :data:`EXTENSION`): ``collective_rpc("bulkinfer_batch_order_install", args=(sort,))``
    runs :func:`install` on each worker, ``"bulkinfer_batch_order_tally"``
    :func:`tally`, in whatever process the worker lives."""

    def bulkinfer_batch_order_install(self, sort: bool = True) -> bool:
        return install(self, sort)

    def bulkinfer_batch_order_tally(self) -> dict[str, float] | None:
        return tally(self)
