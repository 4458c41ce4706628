"""OpenBLAS under `kvcellar model train` on Linux.

The `mlx[cpu]` wheel links its matmuls against the reference BLAS it bundles,
which ran at ~1.5 GFLOP/s here against ~37 GFLOP/s for OpenBLAS: a training
step of the demo-coder took 11 s instead of 1.1 s. The wheel's library is
loaded when MLX is imported, so the only way to swap it is the dynamic
loader's `LD_PRELOAD` at process start: `kvcellar model train` re-executes
itself once with the system's OpenBLAS added to `LD_PRELOAD` (after whatever
is there: `stdbuf`, for one, works by preloading). It does nothing where it
cannot help or was decided already: not Linux, no OpenBLAS installed (Debian:
`apt install libopenblas0-pthread`), an OpenBLAS preloaded already, or
`LD_PRELOAD` set to the empty string (the way to opt out).

Only training does this: `serve` keeps the wheel's libraries, so its figures
compare like with like against `mlx_lm.server` run the same way.
"""

from __future__ import annotations

import ctypes.util
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

PRELOAD_ENV = "LD_PRELOAD"
# Where Debian/Ubuntu (both architectures) and Fedora put the pthread build's library.
OPENBLAS_PATHS = (
    Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0"),
    Path("/usr/lib/aarch64-linux-gnu/libopenblas.so.0"),
    Path("/usr/lib64/libopenblas.so.0"),
    Path("/usr/lib/libopenblas.so.0"),
)
_MAPS_PATH = Path("/proc/self/maps")


def find_openblas(paths: Sequence[Path] = OPENBLAS_PATHS) -> str | None:
    """The first of `paths` that exists, else what the loader's cache names (`ldconfig -p`), else None."""
    for path in paths:
        if path.exists():
            return str(path)
    return ctypes.util.find_library("openblas")


def preload_environment(environ: Mapping[str, str], *, system: str, library: str | None) -> dict[str, str] | None:
    """The environment to re-execute with, or None to carry on as is."""
    preloaded = environ.get(PRELOAD_ENV)
    if system != "Linux" or library is None or preloaded == "" or "openblas" in (preloaded or ""):
        return None
    return {**environ, PRELOAD_ENV: f"{preloaded}:{library}" if preloaded else library}


def reexec_with_openblas() -> None:
    """Replace this process by itself with OpenBLAS preloaded, when it helps (see the module
    docstring); returns only when it does nothing. Call it first thing in a process's own
    entry point, never in-process (tests)."""
    environment = preload_environment(os.environ, system=platform.system(), library=find_openblas())
    if environment is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environment)


def loaded_blas(maps_path: Path = _MAPS_PATH) -> str:
    """Which BLAS this process has mapped: `openblas`, `reference` (the wheel's bundled
    `libblas`), or `unknown` (no /proc, e.g. macOS, where MLX uses Accelerate)."""
    try:
        maps = maps_path.read_text()
    except OSError:
        return "unknown"
    if "libopenblas" in maps:
        return "openblas"
    return "reference" if "libblas" in maps else "unknown"
