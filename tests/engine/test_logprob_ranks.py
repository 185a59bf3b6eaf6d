"""Logprob ranks counted eagerly (bulkinfer.engine.logprob_ranks): the same
counts as vLLM's function without its ``torch.compile``, put in the place
vLLM's sampler calls by the worker's step hook. That the real engine's
logprobs come out right with it is tests/e2e/test_structured_e2e.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.sample import sampler
from vllm.v1.sample.ops.logprobs import batched_count_greater_than

from bulkinfer.engine import batch_order, logprob_ranks

VLLMS = batched_count_greater_than._torchdynamo_orig_callable  # type: ignore[attr-defined]  # the function, uncompiled


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_the_counts_are_vllms_ties_included(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    logprobs = torch.log_softmax(torch.randn(rows, 300, generator=generator), dim=-1)
    logprobs[:, :50] = logprobs[:, 50:100]  # tied values: >= counts each
    picked = torch.randint(0, 300, (rows, 1), generator=generator)
    values = logprobs.gather(-1, picked)
    counted = logprob_ranks.eager_count(logprobs, values)
    assert counted.shape == (rows,) and counted.dtype == torch.int64
    assert torch.equal(counted, VLLMS(logprobs, values))
    assert bool((counted >= 1).all())  # the token itself counts: ranks are 1-based


def test_the_workers_step_hook_puts_it_in_place_of_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler, "batched_count_greater_than", batched_count_greater_than)
    runner = SimpleNamespace(_may_reorder_batch=lambda output: None, reorder_batch_threshold=None)
    assert batch_order.install(SimpleNamespace(model_runner=runner)) is True
    assert sampler.batched_count_greater_than is logprob_ranks.eager_count
    monkeypatch.delattr(sampler, "batched_count_greater_than")
    assert logprob_ranks.install() is False  # another vLLM without the name: nothing changed
