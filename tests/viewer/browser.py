"""Headless Debian chromium driven through chromedriver (selenium), never a downloaded browser."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

CHROMIUM = os.environ.get("ROLLOUTD_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("ROLLOUTD_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")


def require_browser() -> None:
    """Skip without Debian's chromium + chromium-driver; under ROLLOUTD_TEST_STRICT=1 (CI, where
    .ci/run installs them) a missing browser fails instead."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not (os.path.isfile(p) and os.access(p, os.X_OK))]
    if missing:
        msg = f"no system browser: {missing} (apt-get install chromium chromium-driver)"
        if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


def start_browser(width: int = 1400, height: int = 1000):
    """A headless chromium with a private profile; the caller quits it (the profile dir goes too)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="rd-chrome-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
              "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-extensions", f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    quit_ = drv.quit

    def quit_all():
        try:
            quit_()
        finally:
            shutil.rmtree(profile, ignore_errors=True)

    drv.quit = quit_all
    return drv


def console_errors(drv) -> list[dict]:
    return [e for e in drv.get_log("browser") if e.get("level") == "SEVERE"]
