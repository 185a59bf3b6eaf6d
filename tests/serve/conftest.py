"""The ``serve`` fixture: start a test server (see :mod:`serving`); closed after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeEngine
from serving import Server


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(engine: Callable[[], FakeEngine] = FakeEngine, **kwargs: Any) -> Server:
        servers.append(Server(tmp_path / "data", engine, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()
