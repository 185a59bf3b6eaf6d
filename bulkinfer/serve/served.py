"""What a server's model serves: a generative model answers
``/v1/chat/completions`` and ``/v1/completions`` (batches and online), an
embedding model ``/v1/embeddings`` (batches through the
:func:`~bulkinfer.jobs.embed.embed` job, online through
:class:`~bulkinfer.jobs.online.OnlineEmbeddings`), on vLLM's pooling runner.
Which one: :func:`~bulkinfer.models.model_task` (a prepared encoder, or a
local sentence-transformers directory, is an embedding model), as
``bulkinfer models`` lists it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bulkinfer.config import Settings
from bulkinfer.default_model import DEFAULT_ENCODER, DEFAULT_MODEL
from bulkinfer.errors import ModelError
from bulkinfer.jobs.embed import embed_job, embedding_settings, sized_encoder_planner
from bulkinfer.jobs.online import Online, OnlineEmbeddings, OnlineRequests
from bulkinfer.jobs.run import GENERATE, Job
from bulkinfer.models import model_task, resolve_model
from bulkinfer.prep.embeddings import EmbedPlanner
from bulkinfer.prep.vocabulary import vocabulary


class ServedEmbedPlanner(EmbedPlanner):
    """A server's embedding planner: a too-long input is not cut (no ``--truncate`` here)."""

    too_long_hint = "shorten it: the server does not cut inputs, as OpenAI's does not"


@dataclass(frozen=True, slots=True)
class Served:
    """The server's model ``task``: ``generate`` or ``embed``."""

    task: str = "generate"

    @property
    def embeds(self) -> bool:
        return self.task == "embed"

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The batch endpoints and online URLs the model answers."""
        return OnlineEmbeddings.urls if self.embeds else OnlineRequests.urls

    def settings(self, settings: Settings) -> Settings:
        """``settings`` for the server's engine (vLLM's pooling runner for an embedding model)."""
        return embedding_settings(settings) if self.embeds else settings

    @property
    def job(self) -> Job:
        """The job each batch runs. A generation job's engine serves the
        batches after it: its KV cache is not sized to it. An embedding
        batch's input longer than the encoder's ``max_seq_length`` fails its
        line (``context_length_exceeded``), as OpenAI's does: never cut."""
        return (
            embed_job(False, ServedEmbedPlanner) if self.embeds else dataclasses.replace(GENERATE, sized_kv_cache=False)
        )

    def online(self, mux: Any, tokenizer: Any, settings: Settings, model_path: str, name: str) -> Online:
        """Online requests on ``mux``'s engine, answers naming model ``name``."""
        if self.embeds:
            planner = sized_encoder_planner(
                ServedEmbedPlanner, False, tokenizer, settings, mux.max_model_len, model_path
            )
            return OnlineEmbeddings(mux, planner, name)
        resolved = settings.resolve_chat_template(tokenizer)
        return OnlineRequests(mux, tokenizer, resolved, name, vocabulary(tokenizer, model_path))


def served(model: str | None) -> Served:
    """What ``model`` (``--model``; None: the default LLM) serves; a model
    that cannot be found is taken as generative (its engine's start then
    fails and says why: ``/health`` is ``failed``). The default models are
    known without preparing them."""
    if model in (None, DEFAULT_MODEL, DEFAULT_ENCODER):
        return Served("embed" if model == DEFAULT_ENCODER else "generate")
    try:
        return Served(model_task(resolve_model(model)))
    except ModelError:
        return Served()
