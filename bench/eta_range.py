"""Is the progress line's ETA range honest? Three real jobs, each run twice
(a first run, then the same job run again, as from cron), each run's ETA
trace (the report's ``eta_trace``) scored against its real end.

Jobs (:func:`bench.eta_trace.record`, in a process of their own, one at a
time: two cores):

- ``sharegpt``: ``sample_data/sharegpt.jsonl`` (300 ShareGPT first turns),
  ``configs/demo.toml`` (max_tokens 128);
- ``short``: 1,000 short questions (:func:`bench.eta.short_prompts`), the
  defaults (max_tokens 256);
- ``multiturn``: the 452 turns of ``sample_data/sharegpt_multiturn.jsonl``
  (each turn repeats the conversation so far: shared prefixes), demo.toml;
- ``steady`` (not in the issue's three; ``--workloads steady``): 5,000 rows
  of a few random words, 8-token answers: a job whose steps stay alike;
- ``choices`` (likewise): :mod:`bench.eta_choices`'s 120 ShareGPT prompts
  of ``n`` 4, ``max_tokens`` 64: rows of several sequences.

Before the first job every completion length stored is removed from the
calibration store, and the step models stored by earlier runs of these jobs
(a run again is timed by its own job's fits); the other step models fitted
on this machine stay: a machine that has run the model. So ``sharegpt``'s
first run knows no lengths, ``short``'s first run has ShareGPT's (another job of the model, as a
newcomer's own job after ``make demo``), ``multiturn``'s the short
questions'. The run again writes the same output, so its ETA starts from
the first run's lengths.

Scores (:func:`bench.eta_trace.score_trace`): the share of estimates from
10% of the run on whose range held the real time left (goal >= 80%), the
widest range from 25% on (goal: within +-50% of the point), the point's
largest error (goal +-35%, from 10% on for a run again, from 50% on for a
first run). Each run's recording (events and report) is kept beside the
results for replay (``python -m bench.eta_trace score``).

``python -m bench.eta_range [--workloads sharegpt,short,multiturn] [--tag T]``
writes ``bench/results/eta-range-T.{json,md}`` and ``eta-range-T-WORKLOAD-{first,again}.json``.

``--again-set KEY=JSON`` (repeatable) runs each job again with a setting
changed (``engine.enforce_eager=false``: a first run eager, its run again
compiled).
``--again-only`` runs each job again only (a run again spoilt, e.g. by
another process on the cores: its first run's lengths are still stored).
``--replay`` runs nothing: it feeds the recordings of tag T through the
estimator as it is now (the lengths the run had: none, the previous job's
first run, or its own first run; a first run's step model as it was
stored, a run again's its first run's fit, as the store gives it today,
its rate rescaled where the run again's engine settings differ, by the
speeds stored on this machine: ``calibration.at_settings``),
and writes
``eta-range-T-replayed.{json,md}`` (``--replayed-as S``: ``eta-range-T-S``,
keeping an earlier replay): to compare a change on the same runs.
``--replay --set NAME=VALUE`` (repeatable) replays with a constant of
:mod:`bulkinfer.report.eta` or :mod:`bulkinfer.report.futures` changed, to
see what a part of the estimator costs (``--set OTHER_JOBS_SPREAD=0``: the
rate's drift away, the range from the lengths alone); ``--tag`` may name
several tags, comma-separated: one page, ``eta-range-S.{json,md}`` for
``--replayed-as S``, each run with its tag.
``--pace T1,T2,...`` runs nothing: for each job of each tag, the seconds its
run again took for each fifth of its completion tokens over its first run's
(greedy jobs: the same tokens; the machine's own wander between two runs
minutes apart), to ``eta-range-pace.{json,md}``.
``--split T1,T2,...`` runs nothing: for each first run of each tag,
replayed, where its point errs from a quarter of its time on: the
completion tokens left against the seconds per token
(:func:`bench.eta_split.split`), to ``eta-range-split.{json,md}``
(``--name N``: ``eta-range-N.{json,md}``, as for ``--pace``).
``--store-fits`` replays the first runs of tag T timed by the step models
stored on this machine, pooled by the rule before ``CALM_SPREAD`` (the
newest five fits) and by today's, and writes ``eta-range-T-calm.{json,md}``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.eta_trace import score_trace
from bench.measure import machine, versions

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORKLOADS = ("sharegpt", "short", "multiturn")
DESCRIBED = {
    "sharegpt": "300 ShareGPT first turns, configs/demo.toml (max_tokens 128)",
    "short": "1,000 short questions, defaults (max_tokens 256)",
    "multiturn": "452 turns of ShareGPT conversations (shared prefixes), configs/demo.toml",
    "steady": "5,000 rows of 4-16 random words, defaults but max_tokens 8 (not in the issue's three)",
    "choices": "120 ShareGPT prompts of n 4, defaults but max_tokens 64 (bench.eta_choices's; not in the three)",
}


def forget_lengths(outputs: list[Path]) -> None:
    """Remove every completion length stored with earlier runs (the ETA's
    priors), and the step models stored by earlier runs of the bench's own
    jobs (``outputs``: a job's run again is timed by its own fits); every
    other figure of the store stays."""
    from bulkinfer.io.files import atomic_write
    from bulkinfer.report.calibration import calibration_path

    path = calibration_path()
    if not path.exists():
        return
    store = orjson.loads(path.read_bytes())
    own = {str(o) for o in outputs}
    for entry in store.get("entries", []):
        if isinstance(entry, dict):
            entry["completion_lengths"] = []
            if entry.get("output") in own:
                entry["step_cost"] = None
    atomic_write(path, orjson.dumps(store, option=orjson.OPT_INDENT_2))


def run_job(workload: str, recording: Path, job_output: Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """One recorded run of ``workload`` (its own process) writing ``job_output``
    with the settings ``overrides`` (``KEY=JSON``); its recording."""
    cmd = [sys.executable, "-m", "bench.eta_trace", "record", workload, "--out", str(recording)]
    cmd += ["--job-output", str(job_output), *(f"--set={item}" for item in overrides)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return orjson.loads(recording.read_bytes())  # type: ignore[no-any-return]


def scored(recording: dict[str, Any], first_run: bool) -> dict[str, Any]:
    """The run's figures and :func:`score_trace` of its report's ETA trace."""
    report = recording["report"]
    trace = report["eta_trace"]
    return {
        "first_run": first_run,
        "generate_s": report["seconds"]["generate"],
        "rows": report["request_counts"]["completed"],
        "completion_tokens": report["tokens"]["completion"],
        "step_cost_stored": trace.get("step_cost_stored"),
        **known_at(recording["events"], 0.25),
        **score_trace(trace["points"], trace["end_s"], first_run),
    }


def known_at(events: list[list[Any]], fraction: float) -> dict[str, float]:
    """What a run knew at ``fraction`` of its time (from its recorded
    events): the share of its rows that had ended (``rows_ended``) and of
    its completion tokens generated (``tokens_generated``): a first run's
    lengths come from the rows ended and the tokens the running ones have."""
    start, end = events[0][1], events[-1][1]
    at = start + fraction * (end - start)
    planned = sum(1 for e in events if e[0] == "p")
    ended = sum(e[2] + e[3] for e in events if e[0] == "u" and e[1] <= at)
    ticks = [e for e in events if e[0] == "t"]
    generated = max((e[2] for e in ticks if e[1] <= at), default=0)
    return {"rows_ended": ended / planned if planned else 0.0, "tokens_generated": generated / ticks[-1][2]}


def replayed(workloads: list[str], tag: str) -> list[dict[str, Any]]:
    """Each recording of ``tag`` replayed through today's estimator (see the module docstring)."""
    runs = []
    for k, workload in enumerate(workloads):
        for first_run in (True, False):
            name, recording, estimates = _replay(tag, workloads, k, first_run)
            progress = None
            for _, seen in estimates:
                progress = seen
            assert progress is not None
            events = recording["events"]
            score = score_trace(progress.eta_trace, events[-1][1] - events[0][1], first_run)
            runs.append({"workload": workload, "recording": name, **scored(recording, first_run), **score})
    return runs


def _replay(tag: str, workloads: list[str], k: int, first_run: bool) -> tuple[str, dict[str, Any], Iterator[Any]]:
    """The recording of ``tag``'s job ``workloads[k]`` (its first run or its
    run again): its name, its content, and (time, progress) as replayed
    through today's estimator with what the run had (see the module docstring)."""
    from bench.eta_trace import _replayed, fitted_step_cost
    from bulkinfer.report.calibration import at_settings
    from bulkinfer.report.step_cost import StepCost

    name = f"eta-range-{tag}-{workloads[k]}-{'first' if first_run else 'again'}.json"
    recording = orjson.loads((RESULTS / name).read_bytes())
    trace = recording["report"]["eta_trace"]
    step_cost = StepCost.from_json(trace["step_cost"]) if trace["step_cost_stored"] else None
    # the lengths the run had: its own first run's (again), the previous job's first run's, or none
    first = RESULTS / f"eta-range-{tag}-{workloads[k]}-first.json"
    previous = RESULTS / f"eta-range-{tag}-{workloads[k - 1]}-first.json" if k else None
    prior = previous if first_run else first
    # a run again: its first run's fit, the job's own step model (its rate where the engine settings match)
    own = None
    if not first_run:
        earlier = orjson.loads(first.read_bytes())
        engines = earlier["report"]["engine"], recording["report"]["engine"]
        # a rate of other settings: rescaled by the speeds stored on the machine that recorded them (this one)
        own = at_settings(fitted_step_cost(earlier), *engines, recording["report"]["model_path"], recording["machine"])
    return name, recording, _replayed(recording, prior, not first_run, own or step_cost, own is not None)


def store_fits_replayed(workloads: list[str], tag: str) -> dict[str, Any]:
    """Each first run of ``tag`` replayed with the step model pooled from the
    fits in this machine's calibration store, by the rule before
    :data:`~bulkinfer.report.step_cost.CALM_SPREAD` (the newest five, every
    fit) and by today's (calm fits only; none: the defaults)."""
    from bench.eta_trace import _replayed
    from bulkinfer.report.calibration import load_calibrations
    from bulkinfer.report.step_cost import CALM_SPREAD, POOLED_FITS, StepCost, median_model, pooled

    found = [StepCost.from_json(e.get("step_cost")) for e in load_calibrations()]
    fits = [f for f in found if f is not None]
    rules = {"every fit": median_model(fits[-POOLED_FITS:]), f"calm fits (spread <= {CALM_SPREAD})": pooled(fits)}
    runs = []
    for rule, step_cost in rules.items():
        for k, workload in enumerate(workloads):
            recording = orjson.loads((RESULTS / f"eta-range-{tag}-{workload}-first.json").read_bytes())
            prior = RESULTS / f"eta-range-{tag}-{workloads[k - 1]}-first.json" if k else None
            progress = None
            for _, seen in _replayed(recording, prior, False, step_cost):
                progress = seen
            assert progress is not None
            events = recording["events"]
            score = score_trace(progress.eta_trace, events[-1][1] - events[0][1], True)
            timed = step_cost.to_json() if step_cost else "defaults"
            runs.append({"rule": rule, "step_cost": timed, **scored(recording, True), **score, "workload": workload})
    return {"fits": [f.to_json() for f in fits], "runs": runs}


def fifths(recording: dict[str, Any]) -> list[float]:
    """Seconds a run took for each fifth of its completion tokens (from its engine counts)."""
    ticks = [e for e in recording["events"] if e[0] == "t"]
    total, out, last, k = ticks[-1][2], [], ticks[0][1], 1
    for e in ticks:
        if k <= 5 and e[2] >= k * total / 5:
            out.append(e[1] - last)
            last, k = e[1], k + 1
    return out


def pace(tags: list[str], workloads: list[str]) -> dict[str, Any]:
    """:func:`fifths` of each run again over its first run's, for each job of each tag."""
    rows = []
    for tag in tags:
        for workload in workloads:
            first, again = (
                orjson.loads((RESULTS / f"eta-range-{tag}-{workload}-{run}.json").read_bytes())
                for run in ("first", "again")
            )
            tokens = [r["report"]["tokens"]["completion"] for r in (first, again)]
            ratios = [b / a for a, b in zip(fifths(first), fifths(again), strict=False)]
            rows.append({"tag": tag, "workload": workload, "completion_tokens": tokens, "again_over_first": ratios})
    return {"runs": rows}


def render_pace(doc: dict[str, Any]) -> str:
    lines = [
        "# A job's two runs, fifth by fifth of their completion tokens\n",
        f"Command: `{doc['command']}` (from the committed recordings). Each figure: the seconds the run again "
        "took for that fifth of its completion tokens over its first run's.\n",
        "| round | job | completion tokens (first / again) | 1st | 2nd | 3rd | 4th | 5th |",
        "| --- | --- | --- | --: | --: | --: | --: | --: |",
    ]
    for r in doc["runs"]:
        ratios = " | ".join(f"{x:.2f}" for x in r["again_over_first"])
        first, again = r["completion_tokens"]
        lines.append(f"| {r['tag']} | {r['workload']} | {first:,} / {again:,} | {ratios} |")
    return "\n".join(lines) + "\n"


def render(doc: dict[str, Any]) -> str:
    """The Markdown table of a bench run."""
    m = doc["machine"]
    lines = [
        f"# The ETA range against the real end ({m['cpu']} ({m.get('cpu_kind', '')}), {m['logical_cores']} cores)\n",
        f"Command: `{doc['command']}`. Goals: range held the real time left on >= 80% of estimates from 10% of "
        "the run on; from 25% on no wider than +-50% of the point; the point within +-35% (from 10% on for a "
        "run again, from 50% on for a first run); widths and point errors not on the last 10 s.\n",
        "| job | run | generate s | estimates | range held | widest (from 25%) | median width | "
        "largest point error | goals met | at 25%: rows ended, tokens generated |",
        "| --- | --- | --: | --: | --: | --: | --: | --: | --- | --: |",
    ]
    if doc.get("set"):
        lines[1:1] = [f"Replayed with {', '.join(doc['set'])} (bench.eta_range --set).\n"]
    if "fits" in doc:
        lines[2:2] = [f"Step models in the store (oldest first): {doc['fits']}\n"]
        lines[-2] = "| timed by | " + lines[-2][2:]
        lines[-1] = "| --- | " + lines[-1][2:]
    for row in doc["runs"]:
        rule = f"{row['rule']}: {row['step_cost']} | " if "rule" in row else ""
        rule += f"{row['tag']}: " if "tag" in row else ""
        lines.append(
            f"| {rule}{row['workload']} ({DESCRIBED[row['workload']]}) | {'first' if row['first_run'] else 'again'} "
            f"| {row['generate_s']:.0f} | {row['estimates']} | {_pct(row['coverage'])} "
            f"| +-{_pct(row['max_half_width'])} | +-{_pct(row['median_half_width'])} "
            f"| {_pct(row['max_point_error'], signed=True)} (from {row['point_error_from']:.0%}) "
            f"| {'yes' if row['met'] else 'no'} "
            f"| {_pct(row.get('rows_ended'))}, {_pct(row.get('tokens_generated'))} |"
        )
    return "\n".join(lines) + "\n"


def overridden(settings: list[str]) -> None:
    """Each ``NAME=VALUE`` set on :mod:`bulkinfer.report.eta` or
    :mod:`bulkinfer.report.futures`, whichever has it, as the constant's type
    (``0``/``1`` for a flag). Raises SystemExit for a name neither has."""
    import bulkinfer.report.eta as eta
    import bulkinfer.report.futures as futures

    for setting in settings:
        name, _, value = setting.partition("=")
        module = eta if hasattr(eta, name) else futures
        if not hasattr(module, name):
            raise SystemExit(f"bench.eta_range: --set {setting}: no such constant in report.eta or report.futures")
        old = getattr(module, name)
        setattr(module, name, value == "1" if isinstance(old, bool) else type(old)(value))


def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.0%}" if signed else f"{value:.0%}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--tag", default="default")
    parser.add_argument("--replay", action="store_true", help="re-score the recordings of --tag, running nothing")
    parser.add_argument(
        "--replayed-as", default="replayed", help="--replay writes eta-range-TAG-THIS.{json,md} (keep earlier replays)"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="--replay with an estimator constant changed"
    )
    parser.add_argument("--split", default="", help="tags: where each first run's point errs, tokens left or rate")
    parser.add_argument("--pace", default="", help="tags: each job's run again over its first run, fifth by fifth")
    parser.add_argument("--name", default="", help="--split/--pace write eta-range-NAME.{json,md} (split, pace)")
    parser.add_argument(
        "--store-fits",
        action="store_true",
        help="replay --tag's first runs timed by this machine's stored step models, pooled as before and as now",
    )
    parser.add_argument(
        "--again-only", action="store_true", help="run the jobs again only (their first runs' lengths stay stored)"
    )
    parser.add_argument(
        "--again-set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="run each job again with this setting changed (engine.enforce_eager=false: compiled)",
    )
    args = parser.parse_args(argv)
    command = " ".join(["python -m bench.eta_range", *(argv if argv is not None else sys.argv[1:])])
    if args.split:
        from bench.eta_split import render_split, split

        doc: dict[str, Any] = {"command": command, **split(args.split.split(","), args.workloads.split(","))}
        (RESULTS / f"eta-range-{args.name or 'split'}.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        (RESULTS / f"eta-range-{args.name or 'split'}.md").write_text(render_split(doc))
        print(render_split(doc))
        return
    if args.pace:
        paced = {"command": command, **pace(args.pace.split(","), args.workloads.split(","))}
        (RESULTS / f"eta-range-{args.name or 'pace'}.json").write_bytes(orjson.dumps(paced, option=orjson.OPT_INDENT_2))
        (RESULTS / f"eta-range-{args.name or 'pace'}.md").write_text(render_pace(paced))
        print(render_pace(paced))
        return
    if args.store_fits:
        doc = {"command": command, "machine": machine(), "versions": versions()}
        doc.update(store_fits_replayed(args.workloads.split(","), args.tag))
        (RESULTS / f"eta-range-{args.tag}-calm.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        (RESULTS / f"eta-range-{args.tag}-calm.md").write_text(render(doc))
        print(render(doc))
        return
    if args.replay:
        overridden(args.set)
        tags = args.tag.split(",")
        runs = [{"tag": tag, **run} for tag in tags for run in replayed(args.workloads.split(","), tag)]
        doc = {"command": command, "machine": machine(), "versions": versions(), "runs": runs, "set": args.set}
        name = f"eta-range-{tags[0]}-{args.replayed_as}" if len(tags) == 1 else f"eta-range-{args.replayed_as}"
        (RESULTS / f"{name}.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        (RESULTS / f"{name}.md").write_text(render(doc))
        print(render(doc))
        return
    from bulkinfer.default_model import bulkinfer_home

    jobs = bulkinfer_home() / "bench-eta"
    jobs.mkdir(parents=True, exist_ok=True)
    runs = []
    if not args.again_only:
        forget_lengths([jobs / f"{workload}.out.jsonl" for workload in {*WORKLOADS, *args.workloads.split(",")}])
    for workload in args.workloads.split(","):
        output = jobs / f"{workload}.out.jsonl"
        for first_run in (False,) if args.again_only else (True, False):
            name = f"eta-range-{args.tag}-{workload}-{'first' if first_run else 'again'}.json"
            print(f"bench.eta_range: {workload}, {'first run' if first_run else 'again'}", file=sys.stderr, flush=True)
            recording = run_job(workload, RESULTS / name, output, () if first_run else args.again_set)
            runs.append({"workload": workload, "recording": name, **scored(recording, first_run)})
            print(f"  {runs[-1]}", file=sys.stderr, flush=True)
    doc = {"command": command, "machine": machine(), "versions": versions(), "runs": runs}
    earlier = RESULTS / f"eta-range-{args.tag}.json"
    if args.again_only and earlier.exists():  # the other runs of the tag stay, each with its command
        kept = orjson.loads(earlier.read_bytes())
        again = {(r["workload"], r["first_run"]): {**r, "command": command} for r in runs}
        runs = [again.pop((r["workload"], r["first_run"]), r) for r in kept["runs"]] + list(again.values())
        doc = {**kept, "runs": runs, "rerun": command}
    (RESULTS / f"eta-range-{args.tag}.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    (RESULTS / f"eta-range-{args.tag}.md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
