"""Fixtures for the swe task tests.

``swe_cache`` builds every task once per session into the real cache (ROLLOUTD_SWE_CACHE or
~/.cache/rolloutd/swe_tasks), so later runs reuse it and need no network. If the sdists are
not cached and the package index cannot be reached, the tests that need them are skipped
with the pip error as the reason.
"""
from __future__ import annotations

import pytest

from rolloutd.handlers.swe_tasks import DownloadError, build_all, default_cache_dir


@pytest.fixture(scope="session")
def swe_cache():
    cache = default_cache_dir()
    try:
        build_all(cache)
    except DownloadError as exc:
        pytest.skip(f"swe task sdists are not cached in {cache} and could not be downloaded "
                    f"from the package index (no network?): {exc}")
    return cache


@pytest.fixture(scope="session")
def swe_sdist_mirror(swe_cache):
    """The session cache's sdists, usable as an offline mirror (ROLLOUTD_SWE_SDISTS) so tests
    that build into a fresh cache do not download again."""
    return swe_cache / "sdists"
