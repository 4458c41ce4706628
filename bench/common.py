"""What every benchmark shares: the machine description and its section of
`docs/benchmarks.md`, which each benchmark rewrites between its own markers."""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import click
import httpx
import platformdirs
from rich.console import Console
from rich.table import Table

from kvcellar.store.fingerprint import mlx_version

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
        text = text[:begin] + block + text[end + len(end_marker) :]
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
        "mlx": mlx_version(),
    }


def publish(
    name: str,
    result: dict[str, Any],
    section: Callable[[str, str], str],
    *,
    write_docs: bool,
    as_json: bool,
    console: Console,
    progress: Console,
) -> None:
    """The end of every benchmark: with `write_docs`, rewrite its docs section
    (`section(command, run_date)` renders it); with `as_json`, print the
    figures as one JSON object on the last line of standard output."""
    if write_docs:
        command = shlex.join(["python", "-m", f"kvcellar.bench.{name}", *sys.argv[1:]])
        run_date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        rewrite_docs_section(name, section(command, run_date))
        progress.print(f"wrote {DOCS_PATH}")
    if as_json:
        console.file.flush()
        sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
        sys.stdout.flush()


def print_figures(
    title: str,
    columns: tuple[str, ...],
    rows: Sequence[tuple[str, ...]],
    summary: list[str],
    console: Console,
    *,
    text_columns: tuple[str, ...] = ("measurement", "note"),
) -> None:
    """The readable report: one table of figures, then the summary lines."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in text_columns else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for line in summary:
        console.print(line, highlight=False)


@attrs.frozen(kw_only=True)
class Scratch:
    base: Path
    workdir: Path
    model_dir: Path
    model_described: str


@contextmanager
def scratch_with_model(
    prefix: str, directory: Path | None, model_dir: Path | None, progress: Console, *, size: str = "small"
) -> Iterator[Scratch]:
    """A temporary work directory under `directory` (default: kvcellar's user
    cache), removed afterwards, and the model to run: `model_dir`, or the demo
    llama of `size` made inside the work directory."""
    from kvcellar.engine.demo_models import DEMO_ARCH, create_model

    base = directory if directory is not None else platformdirs.user_cache_path("kvcellar") / "bench"
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=base))
    try:
        if model_dir is None:
            progress.print(f"creating the demo {DEMO_ARCH} {size} model")
            model_dir = create_model(DEMO_ARCH, workdir / f"{DEMO_ARCH}-{size}", size=size)
            described = f"demo {DEMO_ARCH} {size}, float32"
        else:
            described = str(model_dir)
        yield Scratch(base=base, workdir=workdir, model_dir=model_dir, model_described=described)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def publish_options(docs_begin: str, docs_end: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--json` and `--write-docs`, the same in every benchmark (`publish` acts on them)."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        command = click.option(
            "--write-docs",
            is_flag=True,
            help=f"Rewrite the section between {docs_begin} and {docs_end} in docs/benchmarks.md.",
        )(command)
        return click.option(
            "--json", "as_json", is_flag=True, help="Print the figures as one JSON object as the last line."
        )(command)

    return decorate


def model_option(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--model DIR` (passed as `model_dir`): an existing mlx-lm model directory, or None."""
    return click.option(
        "--model",
        "model_dir",
        type=click.Path(file_okay=False, exists=True, path_type=Path),
        default=None,
        help=help_text,
    )


def scratch_dir_option(holds: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--dir DIR` (passed as `directory`): where `scratch_with_model` makes its temporary subdirectory."""
    return click.option(
        "--dir",
        "directory",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help=f"Directory for {holds} (a temporary subdirectory is made and removed); "
        "default: kvcellar's user cache directory.",
    )


@attrs.frozen(kw_only=True)
class Figures:
    """A benchmark's figures, the same on the terminal (`show`) and
    in its docs section (`docs_section`): a titled table and summary lines."""

    title: str
    columns: tuple[str, ...]
    rows: Sequence[tuple[str, ...]]
    summary: Sequence[str] = ()
    text_columns: tuple[str, ...] = ("measurement", "note")  # left-aligned, the others right

    def show(self, console: Console) -> None:
        """Print the table and the summary lines (`print_figures`)."""
        summary = list(self.summary)
        print_figures(self.title, self.columns, self.rows, summary, console, text_columns=self.text_columns)

    def markdown(self) -> list[str]:
        """The table, then the summary lines as bullets (when there are any)."""
        alignment = "|".join("---" if column in self.text_columns else "---:" for column in self.columns)
        table = [f"| {' | '.join(self.columns)} |", f"|{alignment}|", *(f"| {' | '.join(row)} |" for row in self.rows)]
        return table + (["", *(f"- {line}" for line in self.summary)] if self.summary else [])


def machine_sentence(machine: dict[str, str], rest: str) -> str:
    """The docs' machine line from `describe_machine`: CPUs, RAM, platform,
    Python and MLX, then `rest` (the back end, the file system, the sharing)."""
    return (
        f"Machine: {machine['cpus']} CPUs ({machine['cpu_model']}), {machine['memory_total']} RAM, "
        f"{machine['platform']}, Python {machine['python']}, MLX {machine['mlx']}{rest}"
    )


def docs_section(heading: str, opening: Sequence[str], figures: Figures, closing: Sequence[str] = ()) -> str:
    """A benchmark's docs section: `## heading`, the opening paragraphs (the
    run, the machine), the figures, the closing paragraphs, a blank line between each."""
    lines = [f"## {heading}"]
    for paragraph in opening:
        lines += ["", paragraph]
    lines += ["", *figures.markdown()]
    for paragraph in closing:
        lines += ["", paragraph]
    return "\n".join(lines)


def publish_figures(
    name: str,
    result: dict[str, Any],
    figures: Figures,
    section: Callable[[str, str], str],
    *,
    write_docs: bool,
    as_json: bool,
    console: Console,
    progress: Console,
) -> None:
    """The end of a benchmark with one table: show `figures`, then `publish`."""
    figures.show(console)
    publish(name, result, section, write_docs=write_docs, as_json=as_json, console=console, progress=progress)


def load_note(load_average: float | None = None) -> str:
    """The machine's load at the end of a run (`load_average`, else the 1-minute load average now),
    as a sentence for a benchmark's prose (the run's own work included: a single-threaded benchmark
    alone shows about 1)."""
    if load_average is None:
        load_average = os.getloadavg()[0]
    return (
        f"Load average at the end of the run: {load_average:.1f} on {os.cpu_count() or 1} CPUs (the benchmark's "
        f"own work included)."
    )


@contextmanager
def timing_calls(owner: object, name: str, spent: list[float]) -> Iterator[None]:
    """Time every call of `owner.name` (a class's method or an instance's bound one) into `spent`."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def collections_timed(spent: list[float]) -> Iterator[None]:
    """Time every cyclic garbage collection that runs inside the block into `spent` (`gc.callbacks`)."""
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            spent.append(time.perf_counter() - started.pop())

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


def wait_until_healthy(
    process: subprocess.Popen[Any],
    base: str,
    *,
    timeout_s: float,
    output: Callable[[], str] = lambda: "",
    name: str = "kvcellar serve",
    poll_s: float = 0.3,
) -> None:
    """Poll `base`/health every `poll_s` until it answers 200. A server that exits first, or is not
    healthy within `timeout_s` (it is then killed), raises `click.ClickException` saying which, with
    `output()` (the server's log or its tail) for the cause."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise click.ClickException(
                f"{name} exited with status {process.returncode} before answering /health:\n{output()}"
            )
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    process.kill()
    process.wait()
    raise click.ClickException(f"{name} was not healthy within {timeout_s:.0f} s:\n{output()}")
