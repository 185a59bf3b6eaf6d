"""What is about one invocation of a job rather than the job itself.

A job (``run``, ``embed``, ``eval``) is its input, its output and its
:class:`~bulkinfer.config.Settings`; :class:`RunContext` carries the rest:
whether it may overwrite or resume, the token that stops it, how it shows
progress and logs, what builds its engine and tokenizer, and who watches it
(:class:`RunObserver`). The CLI, :mod:`bulkinfer`'s functions and the server
each build one and hand it down unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bulkinfer.config import Settings
from bulkinfer.engine.base import EngineFactory
from bulkinfer.engine.factory import vllm_engine
from bulkinfer.engine.malloc import no_huge_pages
from bulkinfer.errors import ConfigError
from bulkinfer.models import TokenizerFactory, load_tokenizer
from bulkinfer.prep.grammar import Grammars
from bulkinfer.prep.vocabulary import check_defaults, vocabulary
from bulkinfer.stop import StopToken


class RunObserver:
    """What a run tells whoever watches it (a server's live batch counts, a
    notebook's progress bar); every method does nothing here: subclass and
    override the ones wanted. Called from the thread the run runs in,
    between engine steps: keep them short (no I/O that can block).
    """

    def started(self, resumed_completed: int, resumed_failed: int) -> None:
        """The run holds its output's lock; ``resumed_*``: rows an
        interrupted attempt finished, kept and not run again (0 on a new run)."""

    def engine_ready(self) -> None:
        """The engine is up (model loaded, KV cache allocated); rows go in from now."""

    def rows_finished(self, completed: int, failed: int, completion_tokens: int) -> None:
        """Rows that ended since the last call (after each engine step that
        ended some, and for rows that fail before the engine): ``completed``
        rows with their ``completion_tokens`` (tokens), ``failed`` rows."""

    def finished(self, report: dict[str, Any]) -> None:
        """The run ended and published its files; ``report`` is ``OUT.report.json``'s content."""


@dataclass(frozen=True, slots=True)
class RunContext:
    """One invocation's choices, the same for ``run``, ``embed`` and ``eval``.

    - ``overwrite`` / ``resume``: ``--overwrite`` (start over) or
      ``--resume`` (keep what an interrupted run finished); not both.
    - ``stop``: set it from any thread to stop cleanly (the CLI sets it on
      SIGINT, SIGTERM and SIGHUP).
    - ``verbose``: the engine's log stays on the terminal instead of ``OUT.log``.
    - ``progress_plain``: one progress line at a time, not a live bar.
    - ``engine_factory(model_path, settings)`` / ``tokenizer_factory(model_path,
      trust_remote_code)``: what builds the engine and the tokenizer (a
      shared or kept engine, or a test's fakes).
    - ``observer``: told when the engine is ready and rows finish.

    Raises:
        ConfigError: ``overwrite`` and ``resume`` both (they contradict).
    """

    overwrite: bool = False
    resume: bool = False
    stop: StopToken = dataclasses.field(default_factory=StopToken)
    verbose: bool = False
    progress_plain: bool = False
    # read when a context is made (a test may patch this module's vllm_engine)
    engine_factory: EngineFactory = dataclasses.field(default_factory=lambda: vllm_engine)
    tokenizer_factory: TokenizerFactory = load_tokenizer
    observer: RunObserver = dataclasses.field(default_factory=RunObserver)

    def __post_init__(self) -> None:
        if self.resume and self.overwrite:
            raise ConfigError("give --resume (continue the interrupted run) or --overwrite (start over), not both")

    @property
    def engine_outlives_run(self) -> bool:
        """The engine is one kept across runs (:func:`bulkinfer.open_engine`,
        a server's): not sized to this job, not closed by it, and its
        processes' output is not this run's to capture."""
        return bool(getattr(self.engine_factory, "outlives_run", False))

    def load_tokenizer(self, model_path: str, settings: Settings, generates: bool) -> Any:
        """The model's tokenizer from :attr:`tokenizer_factory`, its imports
        (torch, transformers) faulted in without huge pages (they are heap
        no engine step reads: :func:`~bulkinfer.engine.malloc.no_huge_pages`);
        for a job that ``generates``, ``settings.sampling``'s token ids are
        checked against the model's vocabulary, and its structured output
        against the engine's grammar backend, before any row is read or an
        engine starts.

        Raises:
            ConfigError: a ``[sampling]`` default names a token id outside
                the vocabulary, or a structured output vLLM refuses
                (:func:`~bulkinfer.prep.vocabulary.check_defaults`).
        """
        with no_huge_pages():
            tokenizer = self.tokenizer_factory(model_path, settings.engine.trust_remote_code)
        if generates:
            check_defaults(vocabulary(tokenizer, model_path), settings.sampling, Grammars(tokenizer, settings.engine))
        return tokenizer

    def replace(self, **changes: Any) -> RunContext:
        """This context with ``changes`` (field name -> value)."""
        return dataclasses.replace(self, **changes)
