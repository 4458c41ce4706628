"""`kvcellar model train` re-executes itself once with OpenBLAS preloaded where
that helps, and leaves every other case alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcellar.blas_preload import (
    CORETYPE_ENV,
    PINNED_CORETYPE,
    PINNED_CORETYPE_CPU_FLAGS,
    PRELOAD_ENV,
    blas_note,
    cpu_flags,
    find_openblas,
    loaded_blas,
    preload_environment,
)

LIBRARY = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


def test_linux_with_openblas_gets_it_preloaded_after_what_is_there():
    assert preload_environment({"A": "1"}, system="Linux", library=LIBRARY) == {"A": "1", PRELOAD_ENV: LIBRARY}
    stdbuf = {PRELOAD_ENV: "/usr/libexec/coreutils/libstdbuf.so"}
    assert preload_environment(stdbuf, system="Linux", library=LIBRARY) == {
        PRELOAD_ENV: f"{stdbuf[PRELOAD_ENV]}:{LIBRARY}"
    }


AVX512 = PINNED_CORETYPE_CPU_FLAGS | {"fpu", "avx2"}


def test_an_avx512_cpu_gets_the_committed_models_kernels_pinned():
    assert preload_environment({}, system="Linux", library=LIBRARY, flags=AVX512) == {
        PRELOAD_ENV: LIBRARY,
        CORETYPE_ENV: PINNED_CORETYPE,
    }
    # OpenBLAS preloaded already but not pinned: one re-exec to pin it (it reads the variable when loaded).
    preloaded = {PRELOAD_ENV: LIBRARY}
    assert preload_environment(preloaded, system="Linux", library=LIBRARY, flags=AVX512) == {
        PRELOAD_ENV: LIBRARY,
        CORETYPE_ENV: PINNED_CORETYPE,
    }


@pytest.mark.parametrize(
    "environ",
    [{PRELOAD_ENV: LIBRARY, CORETYPE_ENV: "Haswell"}, {PRELOAD_ENV: LIBRARY, CORETYPE_ENV: PINNED_CORETYPE}],
    ids=["users-choice", "after-the-reexec"],
)
def test_a_chosen_coretype_is_kept_and_the_reexec_happens_once(environ):
    assert preload_environment(environ, system="Linux", library=LIBRARY, flags=AVX512) is None


def test_without_avx512_nothing_is_pinned():
    avx2_only = frozenset({"fpu", "avx2", "avx512f"})  # AVX-512 F alone does not run SkylakeX's kernels
    assert preload_environment({}, system="Linux", library=LIBRARY, flags=avx2_only) == {PRELOAD_ENV: LIBRARY}
    assert preload_environment({PRELOAD_ENV: LIBRARY}, system="Linux", library=LIBRARY, flags=avx2_only) is None


def test_what_model_train_says_about_its_blas():
    assert blas_note("openblas", PINNED_CORETYPE, None) == ""
    assert blas_note("openblas", PINNED_CORETYPE, PINNED_CORETYPE) == ""
    assert blas_note("unknown", "", None) == ""  # macOS: Accelerate
    assert "reference BLAS" in blas_note("reference", "", None)
    # An environment that chose other kernels (this sandbox sets Haswell) is told how to get the committed weights.
    chosen = blas_note("openblas", "Haswell", "Haswell")
    assert "OPENBLAS_CORETYPE=Haswell is set; unset it" in chosen and "differ" in chosen
    assert "lacks the AVX-512" in blas_note("openblas", "Zen", None)


def test_cpu_flags_reads_the_first_processors_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512f"}
    assert cpu_flags(tmp_path / "absent") == frozenset()


@pytest.mark.parametrize(
    ("environ", "system", "library"),
    [
        ({PRELOAD_ENV: ""}, "Linux", LIBRARY),  # the user decided (an empty value opts out)
        ({PRELOAD_ENV: "/opt/lib/libopenblas64_.so", CORETYPE_ENV: "Zen"}, "Linux", LIBRARY),  # both chosen
        ({}, "Darwin", LIBRARY),  # MLX uses Accelerate there
        ({}, "Linux", None),  # not installed
    ],
    ids=["opted-out", "already-openblas", "macos", "no-openblas"],
)
def test_every_other_case_carries_on_unchanged(environ, system, library):
    # Even on a CPU that runs the pinned kernels.
    assert preload_environment(environ, system=system, library=library, flags=AVX512) is None


def test_the_first_existing_path_wins(tmp_path):
    present = tmp_path / "libopenblas.so.0"
    present.write_bytes(b"")
    assert find_openblas([tmp_path / "absent.so", present]) == str(present)


def test_loaded_blas_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /venv/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0\n")
    assert loaded_blas(maps) == "reference"
    maps.write_text(maps.read_text() + f"7f02-7f03 r-xp 0 08:01 2 {LIBRARY}\n")
    assert loaded_blas(maps) == "openblas"
    assert loaded_blas(tmp_path / "no-proc") == "unknown"


@pytest.mark.skipif(find_openblas() is None or sys.platform != "linux", reason="needs Linux with OpenBLAS installed")
@pytest.mark.parametrize(("preload", "expected"), [(None, "openblas"), ("", "reference")], ids=["default", "opt-out"])
def test_model_train_runs_on_openblas_after_the_reexec(tmp_path, preload, expected):
    # A refused option still goes through the re-exec first; the process then says which BLAS it mapped.
    environ = {key: value for key, value in os.environ.items() if key not in (PRELOAD_ENV, CORETYPE_ENV)}
    if preload is not None:
        environ[PRELOAD_ENV] = preload
    # Also whether that OpenBLAS picks kernels at run time (DYNAMIC_ARCH): only such a build can be pinned.
    script = (
        "import ctypes, sys; from kvcellar.cli import main; "
        "from kvcellar.blas_preload import loaded_blas, openblas_core; "
        "status = main(); config = getattr(ctypes.CDLL(None), 'openblas_get_config', None); "
        "config and setattr(config, 'restype', ctypes.c_char_p); "
        "dynamic = bool(config) and b'DYNAMIC_ARCH' in config(); "
        "print(loaded_blas(), openblas_core() or '-', dynamic); sys.exit(status)"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script, "model", "train", str(tmp_path / "out"), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=environ,
    )
    assert completed.returncode == 2 and "--steps must be more than" in completed.stderr
    blas, core, dynamic = completed.stdout.split()
    assert blas == expected
    if expected == "openblas" and dynamic == "True" and PINNED_CORETYPE_CPU_FLAGS.issubset(cpu_flags()):
        assert core == PINNED_CORETYPE
    assert (core == "-") == (expected == "reference")
