"""The browser the UI tests drive: Debian's Chromium and Playwright (the `ui` extra); .ci/run installs both."""
from __future__ import annotations

import os

import pytest

CHROMIUM = "/usr/bin/chromium"


def _has_playwright() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return True


def missing() -> str | None:
    """Why a browser test cannot run here, or None."""
    if not os.access(CHROMIUM, os.X_OK):
        return f"needs Debian's Chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it as root)"
    if not _has_playwright():
        return "needs Playwright: pip install -c constraints.txt -e '.[ui]' (.ci/run installs it)"
    return None


needs_browser = pytest.mark.skipif(missing() is not None, reason=missing() or "")
