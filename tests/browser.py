"""A headless Chromium for the dashboard's tests: Debian's package driven by Playwright
(never a browser download). Without either, the tests skip, except where
``PAGEDLLM_REQUIRE_BROWSER=1`` (CI) makes a missing browser a failure."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
ARTIFACTS = Path(os.environ.get("PAGEDLLM_TEST_ARTIFACTS", "test-artifacts"))
"""Where screenshots are saved (created on demand; ignored by git)."""


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        missing("Debian's chromium package is not installed (apt-get install chromium)")
    return path


def missing(reason: str):
    if os.environ.get("PAGEDLLM_REQUIRE_BROWSER") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
