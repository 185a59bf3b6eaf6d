"""Batch webhooks: OpenAI's batch events, signed per Standard Webhooks.

When a batch ends (``completed``, ``failed``, ``expired``, ``cancelled``)
with a webhook URL configured, the store records its event in the same
transaction as the status (``webhook_events``, see :mod:`bulkinfer.serve.store`).
:class:`WebhookSender` posts each recorded event until the receiver answers
2xx, and records every attempt, so a restart neither loses an event nor sends
again one that was delivered (a receiver still dedupes by ``webhook-id``: a
crash between its 2xx and our record sends that one again, as every
at-least-once sender may).

The body is OpenAI's batch event object (``openai.types.webhooks``, e.g.
``BatchCompletedWebhookEvent``): ``{"id": "evt_...", "object": "event",
"created_at": UNIX_S, "type": "batch.completed", "data": {"id": BATCH_ID}}``.
Headers per the Standard Webhooks specification (signed with the
``standardwebhooks`` library, as ``openai``'s ``client.webhooks.unwrap``
verifies): ``webhook-id`` (the event id), ``webhook-timestamp`` (Unix s) and
``webhook-signature`` (``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body``
with the ``whsec_`` secret). Retries follow the specification's schedule
(:data:`RETRY_DELAYS_S`); each attempt is a JSON line on the access log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import orjson

from bulkinfer.errors import ConfigError, write_reason
from bulkinfer.serve.access import ACCESS_LOGGER, iso_now
from bulkinfer.serve.store import Store

# Seconds before each retry: the Standard Webhooks specification's example schedule
# ("immediately, 5 seconds, 5 minutes, 30 minutes, 2 hours, 5 hours, 10 hours, 10 hours"):
# eight attempts over about 27 hours, then the event is given up (recorded).
RETRY_DELAYS_S = (5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0)
TIMEOUT_S = 15.0  # one attempt's HTTP timeout (seconds)
STALLED_RETRY_S = 30.0  # the wait after the state database could not be read or written (a full disk)

log = logging.getLogger(ACCESS_LOGGER)


def signer(secret: str) -> Any:
    """A ``standardwebhooks.Webhook`` for ``secret`` (``whsec_`` + base64, as
    OpenAI's and Standard Webhooks' secrets are).

    Raises:
        ConfigError: the secret is empty or not base64.
    """
    from standardwebhooks.webhooks import EmptyWebhookSecretError, Webhook

    try:
        return Webhook(secret)
    except (ValueError, EmptyWebhookSecretError) as exc:  # binascii.Error is a ValueError
        raise ConfigError(f"--webhook-secret: not a whsec_ secret (whsec_ + base64): {exc}") from None


def checked_url(url: str) -> str:
    """``url`` when it is http(s)://HOST...

    Raises:
        ConfigError: any other scheme or no host.
    """
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--webhook-url {url!r}: give an http:// or https:// URL")
    return url


def event_body(event: dict[str, Any]) -> bytes:
    """The JSON body of a recorded event (a ``webhook_events`` row)."""
    return orjson.dumps(
        {
            "id": event["id"],
            "object": "event",
            "created_at": event["created_at"],
            "type": event["type"],
            "data": {"id": event["batch_id"]},
        }
    )


def signed_headers(webhook: Any, event_id: str, body: bytes, at: datetime) -> dict[str, str]:
    """The Standard Webhooks headers of ``body`` sent at ``at`` (UTC)."""
    return {
        "content-type": "application/json",
        "webhook-id": event_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": webhook.sign(event_id, at, body.decode()),
    }


class WebhookSender(threading.Thread):
    """Delivers the store's recorded webhook events in a daemon thread.

    Args:
        store: where events are recorded and their attempts kept.
        secret: the ``whsec_`` signing secret.
        delays: seconds before each retry (the last attempt is the
            ``len(delays) + 1``-th); tests shorten them.
        timeout_s: one attempt's HTTP timeout.

    Raises:
        ConfigError: ``secret`` is not a ``whsec_`` secret.
    """

    def __init__(
        self, store: Store, secret: str, delays: Sequence[float] = RETRY_DELAYS_S, timeout_s: float = TIMEOUT_S
    ):
        super().__init__(name="bulkinfer-webhooks", daemon=True)
        self.store, self.delays, self.timeout_s = store, tuple(delays), timeout_s
        self._webhook = signer(secret)
        self._closing = threading.Event()

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop after the attempt in flight (pending events stay recorded)."""
        self._closing.set()
        self.store.event_added.set()
        if self.is_alive():
            self.join(timeout)

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=self.timeout_s, follow_redirects=False) as client:
            while not self._closing.is_set():
                self.store.event_added.clear()
                try:
                    for event in self.store.due_events(time.time()):
                        if self._closing.is_set():
                            return
                        self._attempt(client, event)
                    due = self.store.next_event_at()
                except Exception as exc:  # noqa: BLE001 (the state database cannot be written: a full disk)
                    stalled = {"time": iso_now(), "webhooks_stalled": write_reason(exc)}
                    log.info(orjson.dumps(stalled).decode())
                    due = time.time() + STALLED_RETRY_S  # the events stay recorded: sent once it can be written
                wait = None if due is None else max(0.0, due - time.time())
                self.store.event_added.wait(wait)

    def _attempt(self, client: Any, event: dict[str, Any]) -> None:
        """One POST of ``event``; its outcome recorded and logged."""
        body = event_body(event)
        headers = signed_headers(self._webhook, event["id"], body, datetime.now(UTC))
        status: int | None = None
        try:
            response = client.post(event["url"], content=body, headers=headers)
            status = response.status_code
            error = None if 200 <= status < 300 else f"HTTP {status}"
        except Exception as exc:  # httpx's transport errors: refused, timed out, TLS
            error = f"{type(exc).__name__}: {exc}"
        attempt = event["attempts"] + 1
        retry = None if error is None or attempt > len(self.delays) else self.delays[attempt - 1]
        self.store.event_attempted(event["id"], error is None, error, None if retry is None else time.time() + retry)
        line = {
            "time": iso_now(),
            "webhook": event["id"],
            "type": event["type"],
            "batch": event["batch_id"],
            "attempt": attempt,
            "status": status,
            "error": error,
            "retry_in_s": retry,
            "gave_up": error is not None and retry is None,
        }
        log.info(orjson.dumps(line).decode())
