"""Headless Chromium for tests that render a page (where ``make test`` could install it)."""

from __future__ import annotations

import shutil

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# No background connections: this machine's network is closed to them.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-sync",
         "--disable-component-update", "--no-first-run"]  # fmt: skip
NO_CHROMIUM = "Chromium is not installed (make browser installs it, as root with apt-get)"
