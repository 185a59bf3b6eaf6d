"""`bulkinfer serve`: OpenAI's Files and Batch API on this machine (see :mod:`bulkinfer.serve`)."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TextIO

import typer

from bulkinfer.cli.app import Command, app, epilog
from bulkinfer.cli.options import ConfigOption, ModelOption, described
from bulkinfer.cli.signals import exit_at_once, fail
from bulkinfer.errors import BulkinferError, ConfigError, write_error

if TYPE_CHECKING:
    from bulkinfer.serve.api import Limits

LOCALHOST = "127.0.0.1"
KEYS_ENV = "BULKINFER_API_KEYS"
WEBHOOK_SECRET_ENV = "BULKINFER_WEBHOOK_SECRET"

EXAMPLES = (
    "bulkinfer serve --api-key sk-team-a --api-key sk-team-b --data-dir /srv/bulkinfer",
    f"{KEYS_ENV}=sk-a,sk-b bulkinfer serve --host 0.0.0.0 --port 8000",
    "bulkinfer serve --model ./my-model",
    "bulkinfer serve --model all-minilm-l6-v2",
    "BULKINFER_WEBHOOK_SECRET=whsec_... bulkinfer serve --webhook-url https://hooks.example.com/batches",
)

SERVE_EXIT_CODES = (
    ("0", "stopped by SIGINT or SIGTERM (a running batch resumes at start)"),
    ("1", "the address cannot be bound (uvicorn's message says why)"),
    ("2", "usage or config error; or a --host beyond 127.0.0.1 without a key"),
    ("9", "the data directory cannot be written"),
)


@app.command(cls=Command, epilog=epilog(EXAMPLES, SERVE_EXIT_CODES))
def serve(
    host: Annotated[
        str, typer.Option(metavar="HOST", help=described("Address to listen on.", LOCALHOST), show_default=False)
    ] = LOCALHOST,
    port: Annotated[
        int, typer.Option(metavar="PORT", help=described("Port to listen on.", 8000), show_default=False)
    ] = 8000,
    data_dir: Annotated[
        Path,
        typer.Option(
            metavar="DIR",
            help=described("Where files, batches and state.sqlite3 are kept.", "bulkinfer-data"),
            show_default=False,
        ),
    ] = Path("bulkinfer-data"),
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KEY",
            help=described(
                f"An API key (repeat for more; also {KEYS_ENV}, comma-separated); each key is a tenant. "
                f"Without any, only {LOCALHOST} is served and any bearer is the tenant 'default'.",
                "none",
            ),
        ),
    ] = None,
    model: ModelOption = None,
    config: ConfigOption = None,
    webhook_url: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help=described(
                "POST OpenAI's batch events (batch.completed, batch.failed, batch.expired, batch.cancelled) "
                "here, signed per Standard Webhooks with --webhook-secret; retried with back-off, each "
                "delivery recorded in state.sqlite3.",
                "none",
            ),
        ),
    ] = None,
    max_online: Annotated[
        int,
        typer.Option(
            metavar="N",
            min=1,
            help=described(
                "Online requests (/v1/chat/completions, /v1/completions) in flight at once; one more gets 429 "
                "with Retry-After. They run on the batches' engine, ahead of batch rows.",
                64,
            ),
            show_default=False,
        ),
    ] = 64,
    batch_beside_online: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            min=0,
            help=described(
                "Batch rows the engine runs while an online request is in flight: the running rows past the "
                "first N sit out its steps (keeping their seats and KV cache), and no new row enters. Fewer make "
                "online answers faster and the batch slower. "
                "--max-online seats (at most half the engine's) are always kept free for online requests.",
                "no bound",
            ),
        ),
    ] = None,
    prefill_beside_online: Annotated[
        int | None,
        typer.Option(
            metavar="TOKENS",
            min=0,
            help=described(
                "While an online request is in flight, a batch row enters the engine only while the prompts "
                "of the batch rows in it not yet prefilled hold fewer tokens than this (0: none enters): "
                "the batch's prefill is what makes an engine step long.",
                "no bound",
            ),
        ),
    ] = None,
    max_file_bytes: Annotated[
        int,
        typer.Option(
            metavar="BYTES",
            min=1,
            help=described("The largest file upload; a larger one gets 413 (OpenAI's batch input limit).", "200 MB"),
            show_default=False,
        ),
    ] = 200 * 1024 * 1024,
    webhook_secret: Annotated[
        str | None,
        typer.Option(
            metavar="whsec_...",
            help=described(f"The webhooks' signing secret (whsec_ + base64; also {WEBHOOK_SECRET_ENV}).", "none"),
        ),
    ] = None,
    batch_file_expiry: Annotated[
        int,
        typer.Option(
            metavar="SECONDS",
            min=0,
            help=described(
                "An upload that names no expires_after is deleted this long after its upload (OpenAI's default "
                "for batch files; never while a batch still reads it); 0 keeps uploads until deleted. An "
                "upload's expires_after and a batch's output_expires_after (its output and error files) are "
                "honoured whatever this says.",
                "2592000 (30 days)",
            ),
            show_default=False,
        ),
    ] = 30 * 24 * 3600,
) -> None:
    """Serve OpenAI's Batch API and online requests, ahead of batch rows, on one warm engine (see README)."""
    keys = [*(api_key or ()), *(k.strip() for k in os.environ.get(KEYS_ENV, "").split(",") if k.strip())]
    try:
        if not keys and host != LOCALHOST:
            raise ConfigError(
                f"--host {host} without an API key: give --api-key KEY or {KEYS_ENV}, or serve {LOCALHOST}"
            )
        webhooks = _webhooks(webhook_url, webhook_secret, os.environ.get(WEBHOOK_SECRET_ENV) or None)
        try:
            from bulkinfer.serve.api import Limits

            expiry = batch_file_expiry or None
            limits = Limits(max_file_bytes, max_online, batch_beside_online, prefill_beside_online, expiry)
            _serve(host, port, data_dir, keys, model, config, webhooks, limits)
        except OSError as exc:
            raise write_error(exc) from exc
    except BulkinferError as exc:
        fail(exc)


def _webhooks(url: str | None, secret: str | None, env_secret: str | None) -> tuple[str, str] | None:
    """The webhook URL and secret (``--webhook-secret``, else ``env_secret``
    from the environment), both checked; None without a URL.

    Raises:
        ConfigError: a URL without a secret, ``--webhook-secret`` without a
            URL, a URL that is not http(s), a secret not ``whsec_`` + base64.
    """
    if url is None:
        if secret is not None:
            raise ConfigError("--webhook-secret without --webhook-url: give the URL the events go to")
        return None
    from bulkinfer.serve.webhooks import checked_url, signer

    secret = secret or env_secret
    if secret is None:
        raise ConfigError(f"--webhook-url needs a signing secret: --webhook-secret whsec_... or {WEBHOOK_SECRET_ENV}")
    signer(secret)
    return checked_url(url), secret


def _serve(
    host: str,
    port: int,
    data_dir: Path,
    keys: list[str],
    model: str | None,
    config: Path | None,
    webhooks: tuple[str, str] | None,
    limits: Limits,
) -> None:
    """Build the store, worker, webhook sender, file sweeper and app; run uvicorn until SIGINT/SIGTERM (one
    JSON access log line a request, a webhook attempt, an expired file, on stderr); then stop the worker (a
    running batch stays ``in_progress`` and resumes at the next start), the sweeper and the sender
    (undelivered events stay recorded)."""
    import uvicorn

    from bulkinfer.config import load_settings
    from bulkinfer.default_model import DEFAULT_MODEL
    from bulkinfer.engine.args import MULTIPROCESSING_ENV
    from bulkinfer.engine.factory import vllm_engine
    from bulkinfer.serve.api import create_app
    from bulkinfer.serve.retention import FileSweeper
    from bulkinfer.serve.store import Store
    from bulkinfer.serve.webhooks import WebhookSender
    from bulkinfer.serve.worker import BatchWorker

    # vLLM's engine core in a child process (unless the user's environment says): an engine crash (a
    # segfault, the OOM killer) is then a death the server recovers from, not the server's end
    os.environ.setdefault(MULTIPROCESSING_ENV, "1")
    settings = load_settings(config, {"model": model})
    store = Store(data_dir, webhook_url=webhooks[0] if webhooks else None)
    worker = BatchWorker(store, settings, vllm_engine, online_seats=limits.max_online,
                         beside_online=(limits.batch_beside_online, limits.prefill_beside_online))  # fmt: skip
    tenants = {key: tenant_of(key) for key in keys}
    app = create_app(store, tenants, worker, limits, settings.model or DEFAULT_MODEL, worker.served.endpoints)
    sender = WebhookSender(store, webhooks[1]) if webhooks else None
    sweeper = FileSweeper(store)
    access = log_access_to(sys.stderr)  # once the server starts: a refused start leaves no handler behind
    worker.start()
    sweeper.start()
    if sender is not None:
        sender.start()
    stops = (signal.SIGINT, signal.SIGTERM)
    # uvicorn stops serving on SIGINT/SIGTERM, then raises the signal again (a
    # bare process would die of it before the worker closes): that one is
    # swallowed; one that comes while the worker closes ends the process at once.
    previous = {sig: signal.signal(sig, _swallow) for sig in stops}
    try:
        uvicorn.run(app, host=host, port=port, access_log=False)  # ours is bulkinfer.serve.access
    finally:
        for sig in stops:
            signal.signal(sig, exit_at_once)
        try:
            worker.close()
            sweeper.close()
            if sender is not None:
                sender.close()
            store.close()
        finally:
            stop_logging_access(access)
            for sig in stops:
                signal.signal(sig, previous[sig])


def _swallow(signum: int, frame: object) -> None:
    """A stop signal uvicorn has already acted on."""


def log_access_to(stream: TextIO) -> logging.Handler:
    """Write the server's access log (the logger ``bulkinfer.serve.access``: one
    JSON line a request, see :mod:`bulkinfer.serve.access`) to ``stream``, and
    only there; returns the handler added."""
    from bulkinfer.serve.access import ACCESS_LOGGER

    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handler


def stop_logging_access(handler: logging.Handler) -> None:
    """Take ``handler`` (of :func:`log_access_to`) off the access log again."""
    from bulkinfer.serve.access import ACCESS_LOGGER

    logging.getLogger(ACCESS_LOGGER).removeHandler(handler)


def tenant_of(key: str) -> str:
    """A key's tenant: a stable name from the key's SHA-256 (the same across
    restarts and key order, and not the key itself)."""
    return "tenant-" + hashlib.sha256(key.encode()).hexdigest()[:16]
