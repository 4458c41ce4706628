"""What every benchmark shares: the machine description and its section of
`docs/benchmarks.md`, which each benchmark rewrites between its own markers."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import mlx.core as mx

DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
DOCS_INTRO = (
    "# Benchmarks\n\nBenchmarks measure ratios against a baseline in the same run; figures are reported "
    "as measured, including misses. Each section names the machine and file system it ran on.\n"
)


def docs_markers(name: str) -> tuple[str, str]:
    """The begin and end markers of benchmark `name`'s section."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def rewrite_docs_section(name: str, section: str, docs_path: Path = DOCS_PATH) -> None:
    """Replace the text between `name`'s markers, creating the file or the
    markers when missing. Reads the file right before writing: several
    benchmarks write their own sections of it."""
    begin_marker, end_marker = docs_markers(name)
    block = f"{begin_marker}\n{section}\n{end_marker}"
    text = docs_path.read_text() if docs_path.exists() else DOCS_INTRO
    begin, end = text.find(begin_marker), text.find(end_marker)
    if begin != -1 and end > begin:
        text = text[:begin] + block + text[end + len(end_marker):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    docs_path.parent.mkdir(parents=True, exist_ok=True)
    docs_path.write_text(text)


def _first_line_with(path: str, prefix: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def filesystem_of(directory: Path) -> str:
    try:
        completed = subprocess.run(["df", "-PT", str(directory)], capture_output=True, text=True, check=True)
        device, kind, *_, mount = completed.stdout.splitlines()[1].split()
    except (OSError, subprocess.CalledProcessError, IndexError, ValueError):
        return "unknown (df -T unavailable)"
    return f"{kind} on {device}, mounted at {mount}"


def describe_machine(directory: Path) -> dict[str, str]:
    cpu_model = _first_line_with("/proc/cpuinfo", "model name") or platform.processor() or "unknown"
    memory_total = _first_line_with("/proc/meminfo", "MemTotal")
    if memory_total is not None and memory_total.endswith(" kB"):
        memory_total = f"{int(memory_total.removesuffix(' kB')) / (1 << 20):.1f} GiB"
    return {
        "cpus": str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()),
        "cpu_model": cpu_model,
        "memory_total": memory_total or "unknown",
        "filesystem": filesystem_of(directory),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
    }
