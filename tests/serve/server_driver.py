"""Runs the server (uvicorn, 127.0.0.1) with a slow fake engine in its own
process, so a test can SIGKILL it mid-batch and start it again.

Usage: python tests/serve/server_driver.py DATA_DIR PORT [--step-delay S]
[--webhook-url URL --webhook-secret whsec_... --webhook-delays S,S,...]
(tests/ must be on PYTHONPATH for ``fakes``; the keys are serving.KEYS.)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import uvicorn
from fakes import FakeEngine, without_native_bfloat16
from serving import KEYS

from bulkinfer.config import load_settings
from bulkinfer.serve.api import create_app
from bulkinfer.serve.store import Store
from bulkinfer.serve.webhooks import WebhookSender
from bulkinfer.serve.worker import BatchWorker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("port", type=int)
    parser.add_argument("--step-delay", type=float, default=0.1)
    parser.add_argument("--webhook-url")
    parser.add_argument("--webhook-secret")
    parser.add_argument("--webhook-delays", default="0.5,0.5,0.5")
    args = parser.parse_args()
    without_native_bfloat16()

    def factory(model: str, settings: Any) -> FakeEngine:
        return FakeEngine(step_delay=args.step_delay)

    store = Store(args.data_dir, webhook_url=args.webhook_url)
    worker = BatchWorker(store, load_settings(None, {"plan.max_in_flight": 4}), factory)
    worker.start()
    if args.webhook_url:
        delays = [float(s) for s in args.webhook_delays.split(",")]
        WebhookSender(store, args.webhook_secret, delays=delays).start()
    uvicorn.run(create_app(store, KEYS, worker, model="tiny"), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
