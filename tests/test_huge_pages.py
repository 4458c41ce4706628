"""`kvcellar serve` re-executes itself once with glibc's huge-page tunable
where that helps, and leaves every other case alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcellar.huge_pages import HUGE_PAGES_TUNABLE, TUNABLES_ENV, reexec_environment


def test_linux_glibc_with_huge_pages_gets_the_tunable():
    environment = reexec_environment({"A": "1"}, system="Linux", glibc=(2, 36), huge_pages=True)
    assert environment == {"A": "1", TUNABLES_ENV: HUGE_PAGES_TUNABLE}


@pytest.mark.parametrize(
    ("environ", "system", "glibc", "huge_pages"),
    [
        ({TUNABLES_ENV: ""}, "Linux", (2, 36), True),  # the user decided (an empty value opts out)
        ({}, "Darwin", None, True),
        ({}, "Linux", None, True),  # musl
        ({}, "Linux", (2, 31), True),  # before the tunable existed
        ({}, "Linux", (2, 36), False),  # transparent huge pages off
    ],
    ids=["already-set", "macos", "not-glibc", "old-glibc", "thp-never"],
)
def test_every_other_case_carries_on_unchanged(environ, system, glibc, huge_pages):
    assert reexec_environment(environ, system=system, glibc=glibc, huge_pages=huge_pages) is None


def test_serve_help_still_answers_after_the_reexec(tmp_path):
    # `serve --help` goes through the re-exec on a Linux host with glibc 2.35+ and THP available.
    environ = {key: value for key, value in os.environ.items() if key != TUNABLES_ENV}
    completed = subprocess.run(
        [sys.executable, "-m", "kvcellar.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=environ,
    )
    assert completed.returncode == 0, completed.stderr
    assert "--ssd-cache-verify" in completed.stdout
