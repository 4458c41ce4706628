"""Transparent huge pages for the server's large allocations (Linux, glibc).

A restore reads each tensor straight into a freshly allocated MLX array, and
on Linux the cost of that memory is page faults: one per 4 KiB page, about
5 us each in the VMs these figures come from, so a 256 MiB entry paid 0.3 s
of faults against a 0.07-0.17 s read. glibc's `glibc.malloc.hugetlb=1`
tunable makes malloc ask for transparent huge pages (`madvise`), which cuts
the faults 512-fold (docs/benchmarks.md, kvfile_io). Tunables are read only at
process start, so `kvcellar serve` re-executes itself once with the tunable
set. It does nothing where it cannot help or was decided already: not Linux,
not glibc 2.35+, huge pages switched off (`never`), or `GLIBC_TUNABLES`
already in the environment (set it, even empty, to opt out).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

TUNABLES_ENV = "GLIBC_TUNABLES"
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
_THP_MODE_PATH = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_GLIBC_MINIMUM = (2, 35)


def _glibc_version() -> tuple[int, ...] | None:
    library, version = platform.libc_ver()
    if library != "glibc" or not version:
        return None
    try:
        return tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None


def _huge_pages_available(mode_path: Path) -> bool:
    """True unless the kernel has transparent huge pages off (`[never]`) or no such setting."""
    try:
        return "[never]" not in mode_path.read_text()
    except OSError:
        return False


def reexec_environment(
    environ: Mapping[str, str], *, system: str, glibc: tuple[int, ...] | None, huge_pages: bool
) -> dict[str, str] | None:
    """The environment to re-execute with, or None to carry on as is."""
    if system != "Linux" or glibc is None or glibc < _GLIBC_MINIMUM or not huge_pages:
        return None
    if TUNABLES_ENV in environ:
        return None
    return {**environ, TUNABLES_ENV: HUGE_PAGES_TUNABLE}


def host_reexec_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`reexec_environment` for this host."""
    return reexec_environment(
        environ, system=platform.system(), glibc=_glibc_version(), huge_pages=_huge_pages_available(_THP_MODE_PATH)
    )


def reexec_with_huge_pages() -> None:
    """Replace this process by itself with the huge-page tunable set, when it
    helps (see the module docstring); returns only when it does nothing. Call
    it first thing in a process's own entry point, never in-process (tests)."""
    environment = host_reexec_environment(os.environ)
    if environment is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environment)
