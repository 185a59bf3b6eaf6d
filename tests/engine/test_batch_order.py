"""The running batch in KV-block order (bulkinfer.engine.batch_order), on a
stand-in for vLLM's InputBatch: only the sort and its hook are tested here;
that vLLM's engine takes it is tests/e2e/test_prefix_e2e.py's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from bulkinfer.engine import batch_order


class Batch:
    """What order_by_blocks reads of vLLM's InputBatch: req_ids, req_id_to_index,
    num_reqs, block_table.block_tables[0].block_table.np, and swap_states, which
    moves a row's whole state (here its id and its block table row)."""

    def __init__(self, tables: dict[str, list[int]], width: int = 10) -> None:
        self.req_ids = list(tables)
        self.req_id_to_index = {rid: i for i, rid in enumerate(self.req_ids)}
        self.table = np.zeros((len(tables) + 2, width), dtype=np.int32)  # spare rows, as vLLM's max_num_reqs
        for i, blocks in enumerate(tables.values()):
            self.table[i, : len(blocks)] = blocks
        self.block_table = SimpleNamespace(block_tables=[SimpleNamespace(block_table=SimpleNamespace(np=self.table))])
        self.swaps: list[tuple[int, int]] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def swap_states(self, i: int, j: int) -> None:
        self.swaps.append((i, j))
        a, b = self.req_ids[i], self.req_ids[j]
        self.req_ids[i], self.req_ids[j] = b, a
        self.req_id_to_index[a], self.req_id_to_index[b] = j, i
        self.table[[i, j]] = self.table[[j, i]]

    def rows(self) -> dict[str, list[int]]:
        return {rid: [int(b) for b in self.table[i] if b] for i, rid in enumerate(self.req_ids)}


def test_siblings_sharing_blocks_end_next_to_each_other_in_block_order() -> None:
    # two conversations (first blocks 7 and 3), their turns scattered as condense leaves them, and a loner
    tables = {
        "a2": [7, 8, 20],
        "lone": [50, 51],
        "b1": [3, 30],
        "a1": [7, 8, 9],
        "b2": [3, 31, 32],
        "a3": [7, 21],
    }
    batch = Batch(tables)
    before = batch.rows()
    swaps = batch_order.order_by_blocks(batch)
    assert batch.req_ids == ["b1", "b2", "a1", "a2", "a3", "lone"]  # by block 0, then 1, then 2
    assert batch.rows() == {rid: before[rid] for rid in batch.req_ids}  # each row kept its own blocks
    assert swaps == len(batch.swaps) > 0
    assert batch.req_id_to_index == {rid: i for i, rid in enumerate(batch.req_ids)}
    assert batch_order.order_by_blocks(batch) == 0  # sorted stays sorted: no swap


def test_rows_that_share_no_block_keep_vllms_order() -> None:
    batch = Batch({"x": [9, 10], "y": [2], "z": [5, 6]})
    assert batch_order.order_by_blocks(batch) == 0
    assert batch.req_ids == ["x", "y", "z"] and not batch.swaps


def test_only_the_first_block_columns_decide() -> None:
    # the same first BLOCK_COLUMNS blocks: their order is vLLM's (lexsort is stable)
    shared = list(range(100, 100 + batch_order.BLOCK_COLUMNS))
    batch = Batch({"late": [*shared, 2], "early": [*shared, 1]}, width=batch_order.BLOCK_COLUMNS + 2)
    assert batch_order.order_by_blocks(batch) == 0
    assert batch.req_ids == ["late", "early"]


def runner(threshold: int | None, batch: Batch, calls: list[Any]) -> SimpleNamespace:
    return SimpleNamespace(
        reorder_batch_threshold=threshold, input_batch=batch, _may_reorder_batch=lambda out: calls.append(out)
    )


def test_install_sorts_after_vllms_own_reorder_and_counts() -> None:
    calls: list[Any] = []
    batch = Batch({"a2": [7, 20], "b": [3], "a1": [7, 9]})
    worker = SimpleNamespace(model_runner=runner(None, batch, calls))
    assert batch_order.tally(worker) is None
    assert batch_order.install(worker) is True
    worker.model_runner._may_reorder_batch("scheduler output")
    assert calls == ["scheduler output"]  # vLLM's reorder ran first
    assert batch.req_ids == ["b", "a1", "a2"]
    tally = batch_order.tally(worker)
    assert tally is not None and (tally["steps"], tally["swaps"]) == (1, len(batch.swaps))


def test_not_installed_where_vllms_backend_orders_the_batch_itself() -> None:
    calls: list[Any] = []
    worker = SimpleNamespace(model_runner=runner(1, Batch({"a": [1]}), calls))  # e.g. MLA: decodes first
    original = worker.model_runner._may_reorder_batch
    assert batch_order.install(worker) is False
    assert worker.model_runner._may_reorder_batch is original
    assert batch_order.install(SimpleNamespace()) is False  # no model runner (another executor's worker)


def test_the_extension_runs_install_and_tally_by_name_on_vllms_worker() -> None:
    """vLLM mixes worker_extension_cls into its worker class; collective_rpc
    then calls these methods by name in whatever process the worker lives."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    assert resolve_obj_by_qualname(batch_order.EXTENSION) is batch_order.BatchOrderExtension

    class Worker(batch_order.BatchOrderExtension):
        def __init__(self, model_runner: Any) -> None:
            self.model_runner = model_runner

    batch = Batch({"a2": [7, 20], "b": [3], "a1": [7, 9]})
    worker = Worker(runner(None, batch, []))
    assert worker.bulkinfer_batch_order_tally() is None
    assert worker.bulkinfer_batch_order_install() is True
    worker.model_runner._may_reorder_batch("scheduler output")
    tally = worker.bulkinfer_batch_order_tally()
    assert batch.req_ids == ["b", "a1", "a2"] and tally is not None and tally["swaps"] == len(batch.swaps) > 0


def test_the_hook_on_generating_cpu_engines_without_an_extension_of_the_users() -> None:
    assert batch_order.hooked("cpu", {"model": "m"})
    assert batch_order.hooked("cpu", {"enable_prefix_caching": False})  # it counts preemptions without sorting
    assert not batch_order.hooked("cuda", {})
    assert not batch_order.hooked("cpu", {"runner": "pooling"})
    assert not batch_order.hooked("cpu", {"worker_extension_cls": "mine.Extension"})


def test_the_block_order_wanted_by_auto_with_the_prefix_cache() -> None:
    assert batch_order.wanted("auto", {"model": "m"})
    assert batch_order.wanted("auto", {"enable_prefix_caching": True})
    assert not batch_order.wanted("vllm", {})
    assert not batch_order.wanted("auto", {"enable_prefix_caching": False})


def test_preemptions_are_counted_from_vllms_scheduler_output_sorting_or_not() -> None:
    for sort in (True, False):
        batch = Batch({"a2": [7, 20], "b": [3], "a1": [7, 9]})
        worker = SimpleNamespace(model_runner=runner(None, batch, []))
        assert batch_order.install(worker, sort=sort) is True
        for preempted in ({"r1", "r2"}, None, set(), {"r1"}):  # vLLM's field: a set of ids, or None
            worker.model_runner._may_reorder_batch(SimpleNamespace(preempted_req_ids=preempted))
        tally = batch_order.tally(worker)
        assert tally is not None and (tally["steps"], tally["preemptions"]) == (4, 3)
        assert batch.req_ids == (["b", "a1", "a2"] if sort else ["a2", "b", "a1"])
        assert tally["swaps"] == len(batch.swaps) == (2 if sort else 0)


def test_draft_tokens_are_counted_from_vllms_scheduler_output() -> None:
    """Speculative decoding: each step's drafts, as vLLM's scheduler names
    them per request (``scheduled_spec_decode_tokens``, empty in a step
    that checks none), add up; a step without the field adds none."""
    worker = SimpleNamespace(model_runner=runner(None, Batch({"a": [1], "b": [2]}), []))
    assert batch_order.install(worker, sort=False)
    for drafts in ({"a": [5, 6, 7, 8], "b": [9]}, {}, None, {"a": [5, 6]}):
        step = SimpleNamespace(preempted_req_ids=None, scheduled_spec_decode_tokens=drafts)
        worker.model_runner._may_reorder_batch(step)
    worker.model_runner._may_reorder_batch(SimpleNamespace())  # neither field
    tally = batch_order.tally(worker)
    assert tally is not None and (tally["steps"], tally["draft_tokens"]) == (5, 7)


def test_accepted_drafts_are_a_requests_tokens_beyond_its_first_in_vllms_output() -> None:
    """A step's ``ModelRunnerOutput.sampled_token_ids`` (vLLM's own record,
    built here as vLLM builds it) holds each request's tokens of the step:
    1 plus the drafts the model accepted (none for a request the model
    rejected every draft of, or that had none). Counted only on a runner
    with a speculative config; the output goes back to vLLM as it came."""
    from vllm.v1.outputs import ModelRunnerOutput

    steps = [[[11, 12, 13], [21]], [[14]], [[], [22, 23]]]  # 2 + 0, 0, 0 (a request with no token) + 1
    ids = ["a", "b"]
    outputs = [
        ModelRunnerOutput(
            req_ids=ids[: len(t)], req_id_to_index={r: i for i, r in enumerate(ids[: len(t)])}, sampled_token_ids=t
        )
        for t in steps
    ]
    for speculating, accepted in ((True, 3), (False, 0)):
        model_runner = runner(None, Batch({"a": [1], "b": [2]}), [])
        model_runner.speculative_config = object() if speculating else None
        model_runner.sample_tokens = iter(outputs).__next__  # vLLM's, one step's output a call
        worker = SimpleNamespace(model_runner=model_runner)
        assert batch_order.install(worker, sort=False)
        assert [worker.model_runner.sample_tokens() for _ in steps] == outputs
        tally = batch_order.tally(worker)
        assert tally is not None and tally["accepted_tokens"] == accepted


class Engine:
    """vLLM's LLMEngine as far as collective_rpc goes: each method runs on every worker."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [getattr(w, method)(*args) for w in self.workers]


def test_step_counts_are_one_workers_since_every_worker_runs_the_same_steps() -> None:
    class Worker(batch_order.BatchOrderExtension):
        def __init__(self) -> None:
            self.model_runner = runner(None, Batch({"a2": [7, 20], "a1": [7, 9]}), [])

    engine = Engine([Worker(), Worker()])  # two tensor-parallel workers
    assert batch_order.install_all(engine, sort=True)
    for worker in engine.workers:
        worker.model_runner._may_reorder_batch(SimpleNamespace(preempted_req_ids={"r1"}))
    assert batch_order.step_counts(engine, sorting=True) == {"preemptions": 1, "batch_order_swaps": 1}
    assert batch_order.step_counts(engine, sorting=False) == {"preemptions": 1}
    assert batch_order.step_counts(engine, sorting=False, speculating=True) == {
        "preemptions": 1,
        "spec_decode_draft_tokens": 0,
        "spec_decode_accepted_tokens": 0,
    }
    refusing = Worker()
    refusing.model_runner.reorder_batch_threshold = 1  # its attention backend orders the batch itself
    assert not batch_order.install_all(Engine([Worker(), refusing]), sort=True)
