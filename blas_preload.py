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

It also pins OpenBLAS's kernels where the CPU can run the ones the committed
demo-coder was trained with (`OPENBLAS_CORETYPE=SkylakeX`, which needs AVX-512):
OpenBLAS otherwise picks its kernels by CPU (Cooperlake's on the AMD EPYC here;
the Intel Xeon that trained the model ran ones that round as SkylakeX's do), or
runs those `OPENBLAS_CORETYPE` names (this machine's environment names Haswell),
and kernel sets round a matmul differently: the same recipe and seed gave other
weights after 28 steps. With the kernels pinned, the same seed gives the same
weights on either CPU (docs/demo-model.md). A value set in the environment is
kept, and `model train` says how to get the committed weights (`blas_note`).

`serve` preloads OpenBLAS too (without the kernel pin), in the same single
re-execution as its huge pages: on the CPU it computes small 16-bit models in
float32 (engine/compute_dtype.py), and float32 matmuls are BLAS calls. A
benchmark comparing it with `mlx_lm.server` runs that one with the same
`LD_PRELOAD` to compare like with like.
"""

from __future__ import annotations

import ctypes.util
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvcellar.cpuinfo import CPUINFO_PATH, cpuinfo_field

PRELOAD_ENV = "LD_PRELOAD"
CORETYPE_ENV = "OPENBLAS_CORETYPE"
# The kernels the committed demo-coder's weights were computed with, and the CPU flags
# they execute (OpenBLAS's SkylakeX target: AVX-512 F, CD, BW, DQ and VL).
PINNED_CORETYPE = "SkylakeX"
PINNED_CORETYPE_CPU_FLAGS = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
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


def cpu_flags(cpuinfo_path: Path = CPUINFO_PATH) -> frozenset[str]:
    """The first CPU's feature flags from /proc/cpuinfo; empty where there is none (macOS)."""
    return frozenset((cpuinfo_field("flags", cpuinfo_path) or "").split())


def preload_environment(
    environ: Mapping[str, str], *, system: str, library: str | None, flags: frozenset[str] = frozenset()
) -> dict[str, str] | None:
    """The environment to re-execute with, or None to carry on as is: OpenBLAS added to
    `LD_PRELOAD` unless one is there, and its kernels pinned where `flags` (the CPU's)
    run them and the user did not choose others."""
    preloaded = environ.get(PRELOAD_ENV)
    if system != "Linux" or library is None or preloaded == "":
        return None
    changes: dict[str, str] = {}
    if "openblas" not in (preloaded or ""):
        changes[PRELOAD_ENV] = f"{preloaded}:{library}" if preloaded else library
    if CORETYPE_ENV not in environ and PINNED_CORETYPE_CPU_FLAGS.issubset(flags):
        changes[CORETYPE_ENV] = PINNED_CORETYPE
    return {**environ, **changes} if changes else None


def reexec_with_openblas() -> None:
    """Replace this process by itself with OpenBLAS preloaded, when it helps (see the module
    docstring); returns only when it does nothing. Call it first thing in a process's own
    entry point, never in-process (tests)."""
    environment = preload_environment(os.environ, system=platform.system(), library=find_openblas(), flags=cpu_flags())
    if environment is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environment)


def serve_preload_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`kvcellar serve`'s environment with OpenBLAS preloaded (None: nothing to change), so the
    float32 compute `--compute-dtype auto` picks on the CPU runs in OpenBLAS rather than the
    wheel's reference BLAS (~5x slower here). No kernel pin: serving needs no bit-identical
    training. `LD_PRELOAD=` opts out, as for training. `kvcellar.cli` re-executes once with
    this and the huge-page tunable together."""
    return preload_environment(environ, system=platform.system(), library=find_openblas())


def reexec_with_serve_openblas() -> None:
    """Replace this process by itself with `serve_preload_environment` (a benchmark measuring
    what `serve` computes with); returns only when it changes nothing."""
    environment = serve_preload_environment(os.environ)
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


def blas_note(blas: str, core: str, chosen_core: str | None) -> str:
    """What `model train` says before it trains on `blas` (`loaded_blas()`) running `core`
    (`openblas_core()`), with `chosen_core` the environment's `OPENBLAS_CORETYPE`; "" when all is as it should be."""
    if blas == "reference":
        return (
            "warning: MLX runs on the wheel's reference BLAS, about 10x slower than OpenBLAS "
            "(Debian/Ubuntu: apt install libopenblas0-pthread; it is then preloaded unless LD_PRELOAD "
            "is the empty string)"
        )
    if blas != "openblas" or core in ("", PINNED_CORETYPE):
        return ""
    why = (
        f"{CORETYPE_ENV}={chosen_core} is set; unset it to regenerate the committed weights"
        if chosen_core
        else "this CPU lacks the AVX-512 they need"
    )
    return (
        f"note: OpenBLAS runs its {core} kernels, not the {PINNED_CORETYPE} ones the committed demo-coder was "
        f"trained with ({why}), so the weights will differ from it by rounding"
    )


def openblas_core() -> str:
    """The kernel set the OpenBLAS this process loaded runs (`Haswell`, `SkylakeX`, ...);
    "" when none is loaded, or it cannot say."""
    try:
        name_of = ctypes.CDLL(None).openblas_get_corename
    except (AttributeError, OSError):
        return ""
    name_of.restype = ctypes.c_char_p
    return (name_of() or b"").decode("ascii", "replace")
