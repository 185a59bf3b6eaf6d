"""vLLM's scheduler, pausing batch rows while an online request is in flight.

vLLM 0.32's scheduler gives every running request its share of each step:
priority decides only who is admitted and who is preempted when KV blocks
run out. So an online request admitted beside a running batch decodes in
steps that carry every running batch row too, and each of its tokens takes
as long as the batch's step (on two CPU cores, 5x its latency alone:
``bench/results/online-latency-online-first-300.md``).

:class:`OnlineFirstScheduler` skips, in each step while an online request
(priority below :data:`~bulkinfer.engine.mux.BATCH_PRIORITY_FLOOR`) is
running or waiting, every running batch row but the first ``beside`` of
those decoding (in the order they were admitted; a row still prefilling
sits out, since its prompt chunk would make the step long), and no batch
row waiting for a seat is admitted (vLLM would fill the step's token budget
with its prefill). A skipped row keeps its seat and its KV
blocks: nothing is recomputed, and it goes on where it stopped at the first
step no online request is in flight. This is vLLM's own way of leaving a
running request out of one step (``Request.next_decode_eligible_step``,
as ``DiffusionAsyncScheduler.schedule`` in vLLM 0.32 does).

An engine is given it by name (:func:`bulkinfer.engine.mux.online_first_args`:
``EngineArgs.scheduler_cls``, and ``beside`` in ``EngineArgs.additional_config``);
this module is imported only in vLLM's engine core process. It expects
vLLM's priority scheduling (an online request waiting is seen at the head of
the waiting queue).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from bulkinfer.engine.mux import BATCH_PRIORITY_FLOOR, BESIDE_KEY

# under vLLM's logger: its handler writes wherever the engine core runs (its own process, or the server's)
logger = logging.getLogger(f"vllm.{__name__}")
FIRST_PAUSE = "online request in flight: batch rows but %d decoding sit out its steps"


class OnlineFirstScheduler(Scheduler):
    """vLLM's synchronous scheduler (the one a CPU engine runs), pausing
    batch rows beside online requests (see the module). ``paused_steps``:
    the steps some batch row sat out (logged at the first, at INFO)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.vllm_config.additional_config
        self.beside = int(config.get(BESIDE_KEY, 0)) if isinstance(config, dict) else 0
        self.paused_steps = 0

    def schedule(self, throttle_prefills: bool = False) -> Any:
        if not self.online_in_flight():
            return super().schedule(throttle_prefills)
        self.pause_batch_rows()
        waiting, self.waiting = self.waiting, create_request_queue(self.policy)
        held: list[Request] = []  # batch rows waiting for a seat: not admitted (their prefill would make the step long)
        for request in waiting:
            (self.waiting.add_request if request.priority < BATCH_PRIORITY_FLOOR else held.append)(request)
        try:
            return super().schedule(throttle_prefills)
        finally:
            for request in held:
                self.waiting.add_request(request)

    def online_in_flight(self) -> bool:
        """An online request runs, or waits at the head of the (priority) queue."""
        if self.waiting and self.waiting.peek_request().priority < BATCH_PRIORITY_FLOOR:
            return True
        return any(request.priority < BATCH_PRIORITY_FLOOR for request in self.running)

    def pause_batch_rows(self) -> None:
        """Leave every running batch row out of the next :meth:`schedule`
        call (it first advances ``current_step``) but the first :attr:`beside`
        of those decoding: a row still prefilling would make the step as long
        as its prompt chunk (up to ``max_num_batched_tokens`` tokens)."""
        kept = paused = 0
        for request in self.running:
            if request.priority < BATCH_PRIORITY_FLOOR:
                continue
            decoding = request.num_tokens - request.num_computed_tokens <= 1  # its one new token left
            if decoding and kept < self.beside:
                kept += 1
                continue
            paused += 1
            request.next_decode_eligible_step = max(request.next_decode_eligible_step, self.current_step + 2)
        if paused:
            if self.paused_steps == 0:
                logger.info(FIRST_PAUSE, self.beside)
            self.paused_steps += 1
