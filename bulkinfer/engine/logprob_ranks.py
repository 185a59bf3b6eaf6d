"""The rank of each token a row asked logprobs for, counted without
``torch.compile`` on CPU.

When any running row asks for logprobs, vLLM 0.32's sampler ranks the
sampled token among its row's log-probabilities with
``batched_count_greater_than`` (``vllm/v1/sample/ops/logprobs.py``,
called from ``vllm/v1/sample/sampler.py``): ``(x >= values).sum(-1)``
under ``@torch.compile`` (so that a GPU does not hold the comparison's
[rows, vocabulary] copy), which compiles at the first such step, even in an
engine that runs eager. On CPU that copy is a bool per logit (200 rows x
49,152 tokens: 9.8 MB; for prompt logprobs, as the perplexity jobs ask, a
row per prompt token of the step, a quarter of the float32 log-probabilities
vLLM holds for them already), and the compilation costs the run a pause at
its first logprobs step: measured with ``python -m bench.startup`` (README,
Engine settings). :func:`install` puts the same expression, eager, in the
sampler's place, in whatever process the worker runs (with the worker's
step hook, :func:`bulkinfer.engine.batch_order.install`): the same counts,
tensor for tensor (``tests/engine/test_logprob_ranks.py`` checks it against
vLLM's uncompiled function).
"""

from __future__ import annotations

from typing import Any


def eager_count(x: Any, values: Any) -> Any:
    """vLLM's ``batched_count_greater_than``, eager: for ``x`` [rows, n]
    and ``values`` [rows, 1], each row's count of elements >= its value,
    shape [rows] (int64)."""
    return (x >= values).sum(-1)


def install() -> bool:
    """Puts :func:`eager_count` in place of the compiled function vLLM's
    sampler module calls, in this process; False (nothing changed) where
    that module has no such name (another vLLM)."""
    from vllm.v1.sample import sampler

    if not callable(getattr(sampler, "batched_count_greater_than", None)):
        return False
    sampler.batched_count_greater_than = eager_count  # type: ignore[assignment]
    return True
