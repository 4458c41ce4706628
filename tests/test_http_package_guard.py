"""`http/` must never shadow the standard library's `http` (design §1)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PROBE_TEST = """
import http, http.client, pathlib, sys
import kvcellar.http

def test_probe():
    assert pathlib.Path(http.__file__).resolve().parent.parent != pathlib.Path({root!r})
    assert pathlib.Path(list(kvcellar.http.__path__)[0]).resolve() == pathlib.Path({root!r}) / "http"
"""


def _is_repo_http(module_file: str) -> bool:
    return Path(module_file).resolve().parent.parent == REPO_ROOT


def test_http_folder_has_no_init_file():
    assert (REPO_ROOT / "http").is_dir()
    assert not (REPO_ROOT / "http" / "__init__.py").exists()


def test_bare_import_http_in_the_test_process_is_the_standard_library():
    import http

    assert not _is_repo_http(http.__file__)


def test_bare_import_http_under_python_c_from_repo_root_is_the_standard_library():
    result = subprocess.run(
        [sys.executable, "-c", "import http, kvcellar.http; print(http.__file__)"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert not _is_repo_http(result.stdout.strip())


def _pytest_launchers() -> list[list[str]]:
    launchers = [[sys.executable, "-m", "pytest"]]
    script = Path(sys.executable).parent / "pytest"
    if script.exists():
        launchers.append([str(script)])
    elif shutil.which("pytest"):
        launchers.append([shutil.which("pytest")])
    return launchers


@pytest.mark.parametrize("launcher", _pytest_launchers(), ids=lambda argv: " ".join(Path(a).name for a in argv))
def test_bare_import_http_under_pytest_from_repo_root_is_the_standard_library(launcher, tmp_path):
    probe = tmp_path / "test_http_probe.py"
    probe.write_text(PROBE_TEST.format(root=str(REPO_ROOT)))
    result = subprocess.run(
        [*launcher, "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(probe)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
