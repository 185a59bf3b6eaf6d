"""The engine side of "never a hang, never an orphan": waiting for an engine
step while watching the engine's processes, the stall timeout, the sampling
defaults checked by vLLM's own SamplingParams, and the watchdog.

No model is loaded here: the waiting logic of VllmEngine runs over a stand-in
step function and a stand-in engine process (a sleeping child). The real
engine core is killed in tests/e2e/test_e2e.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import vllm  # noqa: F401  (without vLLM check_sampling_defaults checks nothing: this module needs it)

from bulkinfer.config import SamplingDefaults
from bulkinfer.engine.sampling import StreamedOutputs, check_sampling_defaults
from bulkinfer.engine.stepper import Stepper
from bulkinfer.engine.vllm import VllmEngine
from bulkinfer.errors import ConfigError, EngineError


def stand_in_engine(
    step: Any, process: subprocess.Popen[bytes], stall_timeout_s: float | None = None, unfinished: bool = False
) -> VllmEngine:
    """A VllmEngine whose vLLM parts are replaced: ``step`` is the engine step,
    ``process`` its one engine process; ``unfinished``: what vLLM's
    ``has_unfinished_requests`` says."""
    engine = object.__new__(VllmEngine)
    engine._engine = SimpleNamespace(has_unfinished_requests=lambda: unfinished)
    engine._stepper = Stepper()
    engine._stepper.step = step
    engine._processes = [psutil.Process(process.pid)]
    engine._names = {process.pid: "VLLM::EngineCore"}
    engine._core_processes = {}
    engine._stall_timeout_s = stall_timeout_s
    engine._buffered = []
    engine._unreported = False
    engine._unfinished = set()
    engine._outputs = StreamedOutputs()
    return engine


@pytest.fixture
def engine_process() -> Any:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_dead_engine_process_ends_a_blocked_step_within_a_second(engine_process: subprocess.Popen[bytes]) -> None:
    never = threading.Event()
    engine = stand_in_engine(lambda: never.wait(), engine_process)  # like vLLM's get_output after its core died
    threading.Timer(0.5, engine_process.kill).start()
    started = time.monotonic()
    with pytest.raises(
        EngineError, match=r"engine process VLLM::EngineCore \(pid \d+\) ended; how is not known here .*dmesg.*--resume"
    ):
        engine.step()
    assert time.monotonic() - started < 1.5  # killed at 0.5 s; processes are checked every 0.2 s


def test_a_step_that_never_returns_is_a_stall_after_the_timeout(engine_process: subprocess.Popen[bytes]) -> None:
    never = threading.Event()
    engine = stand_in_engine(lambda: never.wait(), engine_process, stall_timeout_s=0.6)
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"stuck: no engine step finished in 0.6 s \(plan.stall_timeout_s\)"):
        engine.step()
    assert 0.6 <= time.monotonic() - started < 2.0


def test_step_with_wait_returns_nothing_yet_and_the_results_later(engine_process: subprocess.Popen[bytes]) -> None:
    release = threading.Event()
    finished = SimpleNamespace(
        request_id="7",
        finished=True,
        prompt_token_ids=[1, 2],
        outputs=[SimpleNamespace(index=0, text="hi", token_ids=[5], logprobs=None, finish_reason="stop")],
    )

    def step() -> list[Any]:
        release.wait()
        return [finished]

    engine = stand_in_engine(step, engine_process)
    assert engine.step(wait=0.3) == []  # still running: nothing lost, nothing finished
    release.set()
    done = engine.step(wait=5)
    assert [(c.request_id, c.text, c.finish_reason, c.prompt_tokens, c.completion_tokens) for c in done] == [
        ("7", "hi", "stop", 2, 1)
    ]


def test_the_next_step_starts_before_the_last_ones_outputs_are_handed_over(
    engine_process: subprocess.Popen[bytes],
) -> None:
    """The engine computes step N + 1 while the caller writes step N's rows;
    ``add`` waits for that step (never two at once) and keeps its results."""
    started: list[float] = []
    release = threading.Event()

    def step() -> list[Any]:
        started.append(time.monotonic())
        if len(started) > 1:
            release.wait()
        return []

    engine = stand_in_engine(step, engine_process, unfinished=True)
    assert engine.step(wait=5) == []
    deadline = time.monotonic() + 5
    while len(started) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(started) == 2 and engine.stepping  # the second step runs before anyone asked for it
    release.set()
    engine._wait_step(5)  # what add does before it sends a request
    assert not engine.stepping and len(started) == 2  # waiting for a step in flight does not start another


def test_a_step_add_waited_for_comes_back_alone_even_when_it_finished_nothing(
    engine_process: subprocess.Popen[bytes],
) -> None:
    """Step 2 runs on its own while the caller handles step 1; ``add`` waits
    for it (it finishes no row). The next ``step`` returns step 2 without
    running step 3, so the caller's progress sees step 2's token counts apart
    from step 3's; the call after runs step 3."""
    started: list[int] = []
    generated = [0]

    def step() -> list[Any]:
        started.append(len(started) + 1)
        generated[0] += 10  # each step decodes 10 tokens and finishes no row
        return []

    engine = stand_in_engine(step, engine_process, unfinished=True)
    assert engine.step(wait=5) == [] and engine.stepping  # step 2 started on its own
    engine._finish_step_in_flight()  # what add does before it sends a request
    assert started == [1, 2] and generated == [20] and not engine.stepping
    assert engine.step(wait=5) == [] and started == [1, 2]  # step 2, told alone
    engine._engine.has_unfinished_requests = lambda: False
    assert engine.step(wait=5) == [] and started == [1, 2, 3] and generated == [30]


def test_an_exception_in_the_step_is_an_engine_error(engine_process: subprocess.Popen[bytes]) -> None:
    def step() -> list[Any]:
        raise RuntimeError("boom")

    engine = stand_in_engine(step, engine_process)
    with pytest.raises(EngineError, match="the vLLM engine failed: RuntimeError: boom"):
        engine.step()


def test_sampling_defaults_vllm_rejects_fail_before_any_model_loads() -> None:
    with pytest.raises(ConfigError, match=r"\[sampling\] defaults rejected by vLLM: stop cannot contain an empty"):
        check_sampling_defaults(SamplingDefaults(stop=("",)))
    check_sampling_defaults(SamplingDefaults(stop=("END",), seed=3))  # accepted


WATCHED = r"""
import os, subprocess, sys, time
from bulkinfer.engine.watchdog import Watchdog
watchdog = Watchdog()
time.sleep(0.5)
# a child (a descendant: seen by the watchdog's polling)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
# an orphan: started by a process that exits at once, so it is never a descendant;
# what the watchdog sees of a process started a moment before bulkinfer was killed
orphan = subprocess.run(
    [sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', "
     "'import time; time.sleep(300)'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
    capture_output=True, text=True,
).stdout.strip()
print(child.pid, orphan, watchdog.pid, flush=True)
time.sleep(300)
"""


def test_the_watchdog_kills_engine_processes_when_bulkinfer_is_killed() -> None:
    # its own session and process group, as bulkinfer has under a shell or cron
    driver = subprocess.Popen(
        [sys.executable, "-c", WATCHED], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert driver.stdout is not None
    child, orphan, watchdog = (int(x) for x in driver.stdout.readline().split())
    victims = [psutil.Process(child), psutil.Process(orphan)]
    assert victims[1].ppid() != driver.pid  # not a descendant: re-parented when its parent exited
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    _, alive = psutil.wait_procs(victims, timeout=15)
    assert not alive, f"engine processes outlived bulkinfer: {alive}"
    if psutil.pid_exists(watchdog):
        psutil.wait_procs([psutil.Process(watchdog)], timeout=15)


LEFT_THE_SESSION = r"""
import subprocess, sys, time
from bulkinfer.engine.watchdog import SCAN_MAX_S, Watchdog
watchdog = Watchdog()
time.sleep(4 * SCAN_MAX_S)  # a quiet tree: the watchdog scans it least often by now
# a descendant in a session of its own: not an orphan of this group, found only by the scans
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
time.sleep(SCAN_MAX_S + 0.5)
print(child.pid, flush=True)
time.sleep(300)
"""


def test_the_watchdog_finds_a_new_descendant_within_its_longest_scan_interval() -> None:
    """Scans back off while no process appears (they cost the engine's cores):
    a descendant started after a quiet spell is still known within SCAN_MAX_S."""
    driver = subprocess.Popen(
        [sys.executable, "-c", LEFT_THE_SESSION], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert driver.stdout is not None
    child = psutil.Process(int(driver.stdout.readline()))
    try:
        assert os.getsid(child.pid) != os.getsid(driver.pid)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        _, alive = psutil.wait_procs([child], timeout=15)
        assert not alive, "a descendant started after a quiet spell outlived bulkinfer"
    finally:
        if child.is_running():
            child.kill()


def test_the_watchdog_spares_processes_of_another_run_in_the_same_group() -> None:
    """Two runs started by one script share a process group: killing one
    must not touch the other's engine, started later but with a live parent."""
    driver = subprocess.Popen([sys.executable, "-c", WATCHED], stdout=subprocess.PIPE, text=True)
    assert driver.stdout is not None
    child, orphan, _ = (int(x) for x in driver.stdout.readline().split())
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # same group, after the watchdog
    try:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        _, alive = psutil.wait_procs([psutil.Process(child), psutil.Process(orphan)], timeout=15)
        assert not alive
        time.sleep(0.5)
        assert other.poll() is None  # its parent (this test) is alive and in the group
    finally:
        other.kill()
        other.wait()


ENGINE_WITH_A_QUEUE = """
from multiprocessing import resource_tracker, shared_memory
import time
queue = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(queue._name, "shared_memory")
print(queue.name, flush=True)
time.sleep(300)
"""


# The engine runs from a file: a command line naming the resource tracker is taken for the tracker, which is spared.
SHARED = """
import subprocess, sys, time
from bulkinfer.engine.watchdog import Watchdog
watchdog = Watchdog()
# an engine process with a shared-memory queue whose resource tracker is gone (as in a Ray actor Ray killed)
engine = subprocess.Popen([sys.executable, sys.argv[1]], stdout=subprocess.PIPE, text=True)
print(engine.pid, engine.stdout.readline().strip(), flush=True)
time.sleep(300)
"""


def test_the_watchdog_unlinks_the_shared_memory_a_killed_engine_mapped(tmp_path: Path) -> None:
    """A Ray actor that Ray kills takes its resource tracker along, and its
    engine's shared-memory queues stayed in /dev/shm (2 files per engine,
    every time): the watchdog unlinks what the engine's processes mapped
    there; another process's shared memory is not touched."""
    from multiprocessing import shared_memory

    engine = tmp_path / "engine.py"
    engine.write_text(ENGINE_WITH_A_QUEUE)
    driver = subprocess.Popen(
        [sys.executable, "-c", SHARED, str(engine)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert driver.stdout is not None
    pid, name = driver.stdout.readline().split()
    theirs, ours = Path("/dev/shm") / name, shared_memory.SharedMemory(create=True, size=4096)
    try:
        assert theirs.exists()
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        _, alive = psutil.wait_procs([psutil.Process(int(pid))], timeout=15)
        assert not alive
        deadline = time.monotonic() + 15
        while theirs.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not theirs.exists(), "the killed engine's shared memory outlived it"
        assert (Path("/dev/shm") / ours.name.lstrip("/")).exists()
    finally:
        ours.close()
        ours.unlink()
        theirs.unlink(missing_ok=True)


def test_the_watchdog_stands_down_when_told_done() -> None:
    from bulkinfer.engine.watchdog import Watchdog

    watchdog = Watchdog()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)
        watchdog.close()
        assert sleeper.poll() is None  # a clean shutdown kills nothing
    finally:
        sleeper.kill()
        sleeper.wait()


def test_streamed_outputs_are_joined_and_every_token_counted() -> None:
    """vLLM's own RequestOutput / CompletionOutput records, as DELTA steps
    return them: each holds only the new text and token ids."""
    from vllm.outputs import CompletionOutput, RequestOutput

    def delta(request_id: str, text: str, token_ids: list[int], finish_reason: str | None = None) -> Any:
        choice = CompletionOutput(0, text, token_ids, None, None, finish_reason=finish_reason)
        return RequestOutput(request_id, None, [1, 2, 3], None, [choice], finished=finish_reason is not None)

    outputs = StreamedOutputs()
    assert outputs.completions([delta("a", "The capital", [10, 11]), delta("b", "Hi", [20])]) == []
    assert (outputs.generated_tokens, outputs.prefilled_tokens) == (3, 6)
    assert sorted(outputs.token_counts.values()) == [1, 2]
    done = outputs.completions([delta("a", " is Paris.", [12, 13, 14], "stop"), delta("b", "!", [21])])
    assert [(c.request_id, c.text, c.finish_reason, c.prompt_tokens, c.completion_tokens) for c in done] == [
        ("a", "The capital is Paris.", "stop", 3, 5)
    ]
    assert (outputs.generated_tokens, outputs.prefilled_tokens) == (7, 6)  # a prompt counts once
    assert list(outputs.token_counts.values()) == [2]
    assert outputs.prompt_counts == {"b": 3}  # the running request's prompt: the ETA's context
    outputs.forget(["b"])  # aborted
    assert outputs.token_counts == outputs.prompt_counts == {}


def test_a_request_a_step_finished_on_its_own_is_unfinished_until_handed_over(
    engine_process: subprocess.Popen[bytes],
) -> None:
    """A step that started on its own may finish the last request while no
    one waits for it: vLLM then says nothing is unfinished, but the result is
    still to be collected (a Ray replica's loop stopped calling step, and its
    rows were never returned)."""
    finished = SimpleNamespace(
        request_id="7",
        finished=True,
        prompt_token_ids=[1, 2],
        outputs=[SimpleNamespace(index=0, text="hi", token_ids=[5], logprobs=None, finish_reason="stop")],
    )
    engine = stand_in_engine(lambda: [finished], engine_process, unfinished=False)
    engine._unfinished.add("7")
    engine._stepper.start()  # as a step that started on its own
    assert engine.has_unfinished()  # vLLM would say False: the result is in the step's hands
    assert [c.request_id for c in engine.step(wait=5)] == ["7"]
    assert not engine.has_unfinished()


def test_the_watchdog_spawns_under_the_start_lock_and_its_failure_fails_the_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The watchdog is spawned while the start holds the lock under which
    every start sets its variables: spawned outside it, a replica's watchdog
    failed with EFAULT while the other replica's start added variables (two
    replicas on a 2-core VM; ``python -m bench.spawn_race``). An OSError
    spawning it is the engine's failure to start (exit 5), not an OSError
    escaping to the run, which reported it as a file it cannot write
    ("cannot write .../python: Bad address (EFAULT)", exit 9); the lock and
    the in-process claim are released."""
    import errno

    from bulkinfer.config import EngineSettings
    from bulkinfer.engine import args, processes, watchdog

    locked: list[bool] = []

    def no_spawn() -> Any:
        locked.append(processes._SPAWNING.locked())
        raise OSError(errno.EFAULT, "Bad address", sys.executable)

    monkeypatch.setattr(watchdog, "Watchdog", no_spawn)
    with pytest.raises(EngineError, match=r"the vLLM engine failed to start: OSError: \[Errno 14\] Bad address"):
        VllmEngine(tmp_path, EngineSettings())
    assert locked == [True]
    assert not processes._SPAWNING.locked()
    assert args.IN_PROCESS._owner is None  # released: the next engine may run in this process


def test_engine_settings_vllms_config_refuses_are_a_config_error_not_a_failed_start(tmp_path: Path) -> None:
    """``[engine] dtype = "float33"`` in a config file (the flag's choices
    refuse it at the command line): vLLM's pydantic config refuses it as the
    engine is built, before a process starts; that is the settings' fault
    (exit 2, vLLM's message), not an engine that failed to start (exit 5)."""
    import tiny_model

    from bulkinfer.config import EngineSettings
    from bulkinfer.engine import args
    from bulkinfer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"vLLM refused the engine settings .*\n(.|\n)*'float33'"):
        VllmEngine(tiny_model.build(tmp_path), EngineSettings(dtype="float33"))
    assert args.IN_PROCESS._owner is None  # released: the next engine may run in this process
