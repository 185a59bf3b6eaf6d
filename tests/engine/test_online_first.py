"""OnlineFirstScheduler on vLLM's own scheduler: which requests each step
schedules while an online request is in flight, and that a paused batch row
keeps its KV blocks and goes on where it stopped.

The scheduler is vLLM 0.32's real one (built on a tiny Llama config, no
weights, no engine: as vLLM's tests/v1/core/utils.py builds it); steps are
"run" by handing the scheduler one sampled token per scheduled request.
The real engine runs it in tests/e2e/test_serve_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from bulkinfer.engine.mux import BATCH_PRIORITY_FLOOR, ONLINE_PRIORITY, online_first_args
from bulkinfer.engine.online_first import OnlineFirstScheduler

BLOCK = 32
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
}


def scheduler(tmp_path: Path, beside: int) -> OnlineFirstScheduler:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    model = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=2048)
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=512,
            max_model_len=2048,
            policy="priority",
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK),
        additional_config=online_first_args(beside)["additional_config"],
    )
    config.cache_config.num_gpu_blocks = 1000
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return OnlineFirstScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def request(rid: str, priority: int, prompt_tokens: int = 20, max_tokens: int = 8) -> Request:
    init_none_hash(sha256)
    return Request(
        request_id=rid,
        prompt_token_ids=[7] * prompt_tokens,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        priority=priority,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def step(sched: OnlineFirstScheduler) -> dict[str, int]:
    """One engine step: what the scheduler scheduled (request id -> tokens); each gets one sampled token."""
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=[[5] for _ in ids],
    )
    sched.update_from_output(out, runner)
    return dict(out.num_scheduled_tokens)


@pytest.mark.parametrize("beside", [0, 2])
def test_batch_rows_past_beside_sit_out_online_steps_and_resume(tmp_path: Path, beside: int) -> None:
    sched = scheduler(tmp_path, beside)
    batch = [request(f"b{i}", BATCH_PRIORITY_FLOOR + i) for i in range(4)]
    for r in batch:
        sched.add_request(r)
    assert set(step(sched)) == {r.request_id for r in batch}  # prefill together
    assert set(step(sched)) == {r.request_id for r in batch}  # one decode each
    blocks = {r.request_id: sched.kv_cache_manager.get_block_ids(r.request_id) for r in batch}

    sched.add_request(request("online", ONLINE_PRIORITY, max_tokens=4))
    steps = [step(sched) for _ in range(4)]  # its prefill, then decodes to its 4th token (the last)
    kept = {r.request_id for r in batch[:beside]}
    for scheduled in steps:
        assert set(scheduled) == {"online"} | kept
    assert sched.paused_steps == 4
    assert "online" not in sched.requests  # finished
    for r in batch[beside:]:
        assert r.num_output_tokens == 2 and r.status.name == "RUNNING"  # sat out, still seated
        assert sched.kv_cache_manager.get_block_ids(r.request_id) == blocks[r.request_id]  # kept its KV blocks
    for r in batch[:beside]:
        assert r.num_output_tokens == 6

    assert set(step(sched)) == {r.request_id for r in batch if r.num_output_tokens < 8}  # all go on
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.paused_steps == 4
    assert all(r.num_output_tokens == 8 for r in batch)


def test_no_online_request_no_pause_and_waiting_online_counts(tmp_path: Path) -> None:
    sched = scheduler(tmp_path, 0)
    for i in range(3):
        sched.add_request(request(f"b{i}", BATCH_PRIORITY_FLOOR))
    assert not sched.online_in_flight()
    step(sched)
    assert set(step(sched)) == {"b0", "b1", "b2"} and sched.paused_steps == 0
    sched.add_request(request("online", ONLINE_PRIORITY))
    assert sched.online_in_flight()  # waiting for its prefill: the step that takes it pauses the batch already
    assert set(step(sched)) == {"online"}


def test_beside_comes_from_additional_config(tmp_path: Path) -> None:
    assert scheduler(tmp_path, 3).beside == 3
    args: dict[str, Any] = online_first_args(5)
    assert args["scheduler_cls"] == f"{OnlineFirstScheduler.__module__}.{OnlineFirstScheduler.__qualname__}"


def test_a_batch_row_still_prefilling_sits_out_even_within_beside(tmp_path: Path) -> None:
    sched = scheduler(tmp_path, 2)
    sched.add_request(request("short", BATCH_PRIORITY_FLOOR, prompt_tokens=20, max_tokens=16))
    step(sched)
    sched.add_request(request("long", BATCH_PRIORITY_FLOOR, prompt_tokens=1500, max_tokens=16))
    assert step(sched) == {"short": 1, "long": 511}  # 512-token steps: its prompt takes three
    sched.add_request(request("online", ONLINE_PRIORITY, max_tokens=4))
    scheduled = step(sched)
    assert set(scheduled) == {"short", "online"}  # "long" is within beside, but its next chunk is 512 tokens
    long = sched.requests["long"]
    assert long.num_computed_tokens == 511 and long.status.name == "RUNNING"
    while "online" in sched.requests:
        step(sched)
    assert step(sched)["long"] > 1  # its prefill goes on once the online request is done


def test_a_batch_row_waiting_for_a_seat_is_not_admitted_beside_an_online_request(tmp_path: Path) -> None:
    sched = scheduler(tmp_path, 1)
    sched.add_request(request("b0", BATCH_PRIORITY_FLOOR))
    step(sched)
    sched.add_request(request("online", ONLINE_PRIORITY, max_tokens=3))
    sched.add_request(request("late", BATCH_PRIORITY_FLOOR))  # vLLM would prefill it in the online step's budget
    assert set(step(sched)) == {"online", "b0"}
    assert sched.requests["late"].status.name == "WAITING" and len(sched.waiting) == 1
    while "online" in sched.requests:
        assert "late" not in step(sched)
    assert step(sched)["late"] == 20  # then its prefill
