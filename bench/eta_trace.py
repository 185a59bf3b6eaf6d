"""Record what the progress line's ETA sees during a real run, to study ETA
models offline; and replay a recording into the shipped estimator.

Record (``python -m bench.eta_trace record short``): runs ``bulkinfer.run``
in this process on a workload of :mod:`bench.eta` (``short``: 1,000 short
questions, default settings; ``sharegpt``: ``sample_data/sharegpt.jsonl``
with ``configs/demo.toml``; ``multiturn``: the 452 turns of
``sample_data/sharegpt_multiturn.jsonl``, shared prefixes, likewise;
``steady``: :data:`STEADY_ROWS` rows of 4-16 random words
(:func:`bench.scale.write_rows`), the defaults but ``max_tokens`` 8: every
step alike, as a labelling job's; ``choices``: :mod:`bench.eta_choices`'s
job, :data:`CHOICES_ROWS` ShareGPT prompts of ``n`` 4, the defaults but
``max_tokens`` 64) with :class:`bulkinfer.report.progress.Progress`
wrapped, and writes every call the estimator gets, with its
``time.monotonic()`` second: ``["p", t, prompt_tokens, max_tokens,
sequences, n]`` (a row planned; recordings before sequences were kept end
at ``max_tokens``: one each), ``["u", t, done, failed, completion_tokens,
planned, lengths, sequences]`` (rows ended; likewise), ``["t", t,
generated_tokens, prefilled_tokens, running, cached_tokens,
running_prompt_tokens, ended_sequences]`` (the engine's live counts after a
step; ``running``: each running sequence's completion tokens so far;
``cached_tokens``: of the prompt tokens, those from the prefix cache, absent
from recordings before it was kept; ``running_prompt_tokens``: the running
sequences' prompt tokens, summed, absent before it was kept: a replay then
reconstructs it, :func:`running_prompts`; ``ended_sequences``: choices ended
while their row runs on, absent before it was kept: 0), to ``bench/results/eta-trace-WORKLOAD.json``
with the machine and the run's report.

Replay (``python -m bench.eta_trace replay FILE [--prior-from FILE2]``):
feeds a recording into :class:`bulkinfer.report.eta.WorkEstimate` and prints
the ETA error (ETA / real time left - 1) at 10%, 25%, 50% and 75% of the
time from the first planned row to the last event; with ``--prior-from``,
FILE2's completion lengths are given as an earlier run of the same job
(``--other-job``: of another job of the model).

Score (``python -m bench.eta_trace score FILE [--prior-from FILE2]
[--step-cost-from FILE3]``): replays a recording through the shipped
progress line and scores its ETA trace (:func:`score_trace`: how often the
range held the real time left, how wide it was, how far the point was);
``--step-cost-from``: the step model fitted to FILE3's run (an earlier run
of the model on the machine), else the defaults.

Rates (``python -m bench.eta_trace rates FILE [--prior-from FILE2]``): the
live completion tokens/s a progress line could show, since the start and
over trailing windows (:data:`RATE_WINDOWS_S`), and the run's expected
figure it prints, against the run's final figure, every 10 s from 20 s on,
and the worst error of each. One engine at a time (two cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
FRACTIONS = (0.10, 0.25, 0.50, 0.75)
LAST_LINE_S = 10.0
RATE_WINDOWS_S = (30.0, 60.0)
STEADY_ROWS = 5000  # the steady workload's rows (bench.scale.write_rows, seed 0)
RECORDABLE = ("short", "sharegpt", "multiturn", "steady", "choices")  # the jobs record() runs
CHOICES_ROWS = 120  # the choices workload: bench.eta_choices's rows, n 4, max_tokens 64


def record(workload: str, out: Path, job_output: Path | None = None, overrides: dict[str, str] | None = None) -> None:
    """One real run of ``workload`` with the estimator's inputs recorded to
    ``out``; ``job_output``: the run's output file (the same one for a job
    run again: its stored lengths are found by it), else a temporary one;
    ``overrides``: settings changed for this run, dotted keys with JSON
    values (``{"engine.enforce_eager": "false"}``: a compiled engine).
    Only the generation's progress line is recorded (the one with the most
    rows planned): on a machine new to the model the dtype probe's
    perplexity rows have a progress line of their own."""
    import bulkinfer.report.progress as progress
    from bench.eta import short_prompts
    from bulkinfer import load_settings, run
    from bulkinfer.config import with_overrides
    from bulkinfer.engine.args import cpu_model

    events: list[list[Any]] = []
    wrapped = progress.Progress
    tick, update, planned = wrapped.tick, wrapped.update, wrapped.planned

    def on_tick(
        self: Any,
        generated: int,
        prefilled: int,
        running: list[int],
        cached: int = 0,
        prompts: int | None = None,
        ended: int = 0,
    ) -> None:
        events.append([id(self), "t", time.monotonic(), generated, prefilled, list(running), cached, prompts, ended])
        tick(self, generated, prefilled, running, cached, prompts, ended)

    def on_update(self: Any, done: int = 0, failed: int = 0, completion_tokens: int = 0, planned_: bool = True,
                  lengths: Any = (), sequences: int = 1) -> None:  # fmt: skip
        row = [done, failed, completion_tokens, planned_, list(lengths), sequences]
        events.append([id(self), "u", time.monotonic(), *row])
        update(self, done, failed, completion_tokens, planned_, lengths, sequences)

    def on_planned(self: Any, prompt_tokens: int, max_tokens: int, sequences: int = 1, n: int = 1) -> None:
        events.append([id(self), "p", time.monotonic(), prompt_tokens, max_tokens, sequences, n])
        planned(self, prompt_tokens, max_tokens, sequences, n)

    wrapped.tick, wrapped.update, wrapped.planned = on_tick, on_update, on_planned  # type: ignore[assignment,method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        if workload == "short":
            src = Path(tmp) / "short.jsonl"
            src.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in short_prompts(1000)))
            settings = load_settings()
        elif workload == "steady":  # steps alike: 8-token answers to rows of a few words, as a labelling job
            from bench.scale import write_rows

            src = Path(tmp) / "steady.jsonl"
            write_rows(src, STEADY_ROWS)
            settings = load_settings(overrides={"sampling.max_tokens": 8})
        elif workload == "choices":  # bench.eta_choices's job: ShareGPT prompts of 4 choices each
            from bench.eta_choices import write_rows as write_choices

            src = Path(tmp) / "choices.jsonl"
            write_choices(src, CHOICES_ROWS, 4)
            settings = load_settings(overrides={"sampling.max_tokens": 64})
        elif workload == "multiturn":  # 452 turns of real ShareGPT conversations: each turn repeats the earlier ones
            src = ROOT / "sample_data" / "sharegpt_multiturn.jsonl"
            settings = load_settings(ROOT / "configs" / "demo.toml")
        else:
            src, settings = ROOT / "sample_data" / "sharegpt.jsonl", load_settings(ROOT / "configs" / "demo.toml")
        output = job_output or Path(tmp) / "out.jsonl"
        if overrides:
            settings = with_overrides(settings, {key: orjson.loads(value) for key, value in overrides.items()})
        result = run(src, output, settings=settings, overwrite=True, progress_plain=True)
    # the generation run's progress line only: a first run on a machine also runs the dtype probe's
    runs = Counter(e[0] for e in events if e[1] == "p")
    generation = runs.most_common(1)[0][0] if runs else None
    data = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "command": " ".join(
            ["python -m bench.eta_trace record", workload, *(f"--set {k}={v}" for k, v in (overrides or {}).items())]
        ),
        "events": [e[1:] for e in events if e[0] == generation],
        "report": result.report,
    }
    out.write_bytes(orjson.dumps(data))
    print(f"bench.eta_trace: {len(events)} events to {out}", file=sys.stderr)


def replay(path: Path, prior_from: Path | None = None, same_job: bool = True) -> list[float | None]:
    """The shipped estimator's ETA error at each of :data:`FRACTIONS` on a
    recording; with ``prior_from``, given the completion lengths of that
    recording's run as an earlier run's: of this job run again, as from
    cron (``same_job``), or of another job of the model."""
    recording = orjson.loads(path.read_bytes())
    events = recording["events"]
    start, end = events[0][1], events[-1][1]
    etas = [(now - start, progress.eta_s()) for now, progress in _replayed(recording, prior_from, same_job)]
    errors: list[float | None] = []
    for fraction in FRACTIONS:
        at, eta = min(etas, key=lambda x: abs(x[0] - fraction * (end - start)))
        left = end - start - at
        errors.append(None if eta is None or left <= 0 else eta / left - 1)
    return errors


def score_trace(points: list[list[float]], end_s: float, first_run: bool) -> dict[str, Any]:
    """Scores an ETA trace (``[seconds, low, point, high]`` each, the
    report's ``eta_trace.points``) against the run's real end ``end_s`` (its
    ``eta_trace.end_s``): from 10% of the run on, the share of estimates whose
    range held the real time left (``coverage``, goal >= 0.8); from 25% on,
    the widest range as the larger of high / point - 1 and 1 - low / point
    (``max_half_width``, goal <= 0.5); the point's largest error, point /
    real left - 1, from 10% on for a run again and from 50% on for a first
    run (``max_point_error``, goal <= 0.35). Estimates with less than 1 s
    left are not scored, and the width and the point's error not on the
    last :data:`LAST_LINE_S` seconds (the last progress line's interval:
    a second off with 3 s left is not a 33% error to a reader)."""
    scored = [(t, lo, pt, hi, end_s - t) for t, lo, pt, hi in points if t >= 0.10 * end_s and end_s - t >= 1.0]
    held = [lo - 0.5 <= left <= hi + 0.5 for _, lo, _, hi, left in scored]
    relative = [x for x in scored if x[4] >= LAST_LINE_S and x[2] > 0]
    widths = [max(hi / pt - 1, 1 - lo / pt) for t, lo, pt, hi, _ in relative if t >= 0.25 * end_s]
    point_from = 0.5 if first_run else 0.10
    errors = [pt / left - 1 for t, _, pt, _, left in relative if t >= point_from * end_s]
    return {
        "estimates": len(scored),
        "coverage": sum(held) / len(held) if held else None,
        "max_half_width": max(widths, default=None),
        "median_half_width": statistics.median(widths) if widths else None,
        "max_point_error": max(errors, key=abs, default=None),
        "point_error_from": point_from,
        "met": bool(
            held
            and sum(held) / len(held) >= 0.8
            and max(widths, default=0.0) <= 0.5
            and abs(max(errors, key=abs, default=0.0)) <= 0.35
        ),
    }


def replay_score(
    path: Path, prior_from: Path | None = None, same_job: bool = True, step_cost_from: Path | None = None
) -> dict[str, Any]:
    """:func:`score_trace` of the shipped progress line replayed on a recording."""
    recording = orjson.loads(path.read_bytes())
    step_cost = fitted_step_cost(orjson.loads(step_cost_from.read_bytes())) if step_cost_from else None
    progress = None
    for _, seen in _replayed(recording, prior_from, same_job, step_cost):
        progress = seen
    assert progress is not None
    events = recording["events"]
    return score_trace(progress.eta_trace, events[-1][1] - events[0][1], first_run=prior_from is None or not same_job)


def fitted_step_cost(recording: dict[str, Any]) -> Any:
    """The step model fitted to a recording's steps, as its run would have stored it."""
    from bulkinfer.report.eta import WorkEstimate

    events = recording["events"]
    prompts = running_prompts(events)
    work = WorkEstimate(events[0][1])
    for i, e in enumerate(events):
        if e[0] == "p":
            work.plan(*e[2:])
        elif e[0] == "t":
            work.observe(e[1], e[2], e[3], e[4], e[5] if len(e) > 5 else 0, prompts[i])
    return work.fitted_step_cost()


def running_prompts(events: list[list[Any]]) -> dict[int, int | None]:
    """The running requests' prompt tokens, summed, at each ``t`` event (by
    its index): recorded, or for a recording made before they were,
    reconstructed. Requests start in the order they were planned, and a
    request's prompt tokens count as processed at its first output, so the
    processed count gives the rows started by each step exactly; a running
    request with ``g`` tokens started ``g`` steps ago (steps: the events
    whose counts moved): its prompt is the
    mean of the rows started in that step (exact when none of those has
    ended). Checked on the recordings of ``bench/results/eta-range-*``: the
    processed count fell on a boundary between planned rows at every step;
    on the six of ``eta-range-xeon-context-*``, which kept the figure, the
    reconstruction is within 1% of it at the median step, 9% at most."""
    import bisect

    out: dict[int, int | None] = {}
    prompts: list[int] = []
    cumulative = [0]
    started: list[int] = []  # rows started by the end of each step
    moved = (0, 0)  # the generated and processed counts after the last step
    for i, e in enumerate(events):
        if e[0] == "p":
            prompts.append(e[2])
            cumulative.append(cumulative[-1] + e[2])
        elif e[0] == "t" and len(e) > 6:
            out[i] = e[6]
        elif e[0] == "t":
            if (e[2], e[3]) != moved:  # an engine step ended (else the call returned while one ran)
                moved = (e[2], e[3])
                started.append(bisect.bisect_right(cumulative, e[3]) - 1)
            total = 0.0
            for g, n in Counter(e[4]).items():
                at = max(len(started) - g, 0)  # the step whose output held its first token
                while at > 0 and started[at] == started[at - 1]:
                    at -= 1
                first = started[at - 1] if at > 0 else 0
                rows = prompts[first : started[at]] or prompts
                total += n * statistics.fmean(rows) if rows else 0.0
            out[i] = round(total)
    return out


def _replayed(
    recording: dict[str, Any],
    prior_from: Path | None,
    same_job: bool,
    step_cost: Any = None,
    step_cost_same_job: bool = False,
) -> Iterator[tuple[float, Any]]:
    """Feeds a recording's events into the shipped
    :class:`bulkinfer.report.progress.Progress` on the recording's clock;
    yields (time, the progress) at most once a second of that clock.
    ``step_cost_same_job``: ``step_cost`` is this job's own fit."""
    import io

    from bulkinfer.report.calibration import LengthPrior
    from bulkinfer.report.eta import WorkEstimate
    from bulkinfer.report.progress import Progress

    events = recording["events"]
    prompts = running_prompts(events)
    prior: list[int] = []
    if prior_from is not None:
        earlier = WorkEstimate()
        for e in orjson.loads(prior_from.read_bytes())["events"]:
            if e[0] == "u" and e[2] == 1 and not e[3]:
                for length in (e[6] if len(e) > 6 else None) or [e[4]]:
                    earlier.finish(length)
        prior = earlier.length_quantiles()
    clock = [events[0][1]]
    progress = Progress(
        sum(1 for e in events if e[0] == "p"),
        stream=io.StringIO(),
        force_plain=True,
        clock=lambda: clock[0],
        prior=LengthPrior(prior, same_job, step_cost, step_cost_same_job),
        max_running=recording["report"]["engine"].get("max_num_seqs"),
    )
    last = -1.0
    for i, event in enumerate(events):
        kind, clock[0] = event[0], event[1]
        if kind == "p":
            progress.planned(*event[2:])
        elif kind == "u":
            progress.update(*event[2:])
        else:
            ended = event[7] if len(event) > 7 else 0
            progress.tick(event[2], event[3], event[4], event[5] if len(event) > 5 else 0, prompts[i], ended)
        if clock[0] - last >= 1.0:
            last = clock[0]
            yield clock[0], progress


def rates(
    path: Path, prior_from: Path | None = None, same_job: bool = True, every_s: float = 10.0, after_s: float = 20.0
) -> dict[str, list[tuple[float, float]]]:
    """Completion tokens/s a progress line could show against the run's
    final figure, as (seconds, rate / final rate - 1) every ``every_s`` from
    ``after_s`` on: over the time since the first planned row (``so far``),
    over each trailing window of :data:`RATE_WINDOWS_S` seconds, and the
    run's expected figure the progress line prints
    (:meth:`Progress.expected_tokens_per_s`, replayed with ``prior_from`` as
    in :func:`replay`). Final rate = the last step's generated tokens over the
    time from the first planned row to the last event."""
    import bisect

    recording = orjson.loads(path.read_bytes())
    events = recording["events"]
    steps = [(e[1], e[2]) for e in events if e[0] == "t"]
    start, end = events[0][1], events[-1][1]
    final = steps[-1][1] / (end - start)
    times = [t for t, _ in steps]

    def generated_at(t: float) -> tuple[float, int]:
        i = bisect.bisect_right(times, t) - 1
        return steps[i] if i >= 0 else (start, 0)

    out: dict[str, list[tuple[float, float]]] = {"so far": []}
    out.update({f"last {w:.0f} s": [] for w in RATE_WINDOWS_S})
    at = after_s
    while start + at < end:
        t1, g1 = generated_at(start + at)
        out["so far"].append((at, g1 / (t1 - start) / final - 1))
        for w in RATE_WINDOWS_S:
            t0, g0 = generated_at(start + at - w)
            out[f"last {w:.0f} s"].append((at, (g1 - g0) / max(t1 - t0, 1e-9) / final - 1))
        at += every_s
    out["run expected"] = []
    at = after_s
    for now, progress in _replayed(recording, prior_from, same_job):
        expected = progress.expected_tokens_per_s()
        if now - start >= at and now < end:
            if expected is not None:
                out["run expected"].append((at, expected / final - 1))
            at += every_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("workload", choices=RECORDABLE)
    rec.add_argument("--out", type=Path, help="the recording (default bench/results/eta-trace-WORKLOAD.json)")
    rec.add_argument("--job-output", type=Path, help="the run's output file (the same one when the job runs again)")
    rec.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for this run, a JSON value (engine.enforce_eager=false)",
    )
    rep = sub.add_parser("replay")
    rep.add_argument("path", type=Path)
    rat = sub.add_parser("rates")
    rat.add_argument("path", type=Path)
    sco = sub.add_parser("score")
    sco.add_argument("path", type=Path)
    sco.add_argument("--step-cost-from", type=Path, help="a recording whose fitted step model is the stored one")
    for sub_parser in (rep, rat, sco):
        sub_parser.add_argument(
            "--prior-from", type=Path, help="a recording whose completion lengths are the earlier run's"
        )
        sub_parser.add_argument(
            "--other-job", action="store_true", help="--prior-from is another job of the model, not this one run again"
        )
    args = parser.parse_args()
    if args.action == "score":
        print(orjson.dumps(replay_score(args.path, args.prior_from, not args.other_job, args.step_cost_from)).decode())
    elif args.action == "rates":
        series = rates(args.path, args.prior_from, same_job=not args.other_job)
        for name, points in series.items():  # none for a run shorter than 20 s
            worst = max((abs(e) for _, e in points), default=0.0)
            shown = " ".join(f"{at:.0f}s:{e:+.0%}" for at, e in points)
            print(f"{name}: worst {worst:.0%} | {shown}")
    elif args.action == "record":
        out = args.out or ROOT / "bench" / "results" / f"eta-trace-{args.workload}.json"
        record(args.workload, out, args.job_output, dict(item.split("=", 1) for item in args.set))
    else:
        errors = replay(args.path, args.prior_from, same_job=not args.other_job)
        print(
            " ".join(
                f"{round(f * 100)}%: " + ("-" if e is None else f"{e:+.0%}")
                for f, e in zip(FRACTIONS, errors, strict=True)
            )
        )


if __name__ == "__main__":
    main()
