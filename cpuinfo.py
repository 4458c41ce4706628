"""Linux's /proc/cpuinfo, read one field at a time: the serving fingerprint names
the CPU model by it, and `model train` checks the CPU's flags before it pins
OpenBLAS's kernels. Nothing here imports MLX, so process start-up can use it."""

from __future__ import annotations

from pathlib import Path

CPUINFO_PATH = Path("/proc/cpuinfo")


def cpuinfo_field(name: str, cpuinfo_path: Path = CPUINFO_PATH) -> str | None:
    """The first processor's non-empty `name` field (`model name`, `flags`), stripped;
    None where the file or the field is missing (macOS has no /proc)."""
    try:
        text = cpuinfo_path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name and value.strip():
            return value.strip()
    return None
