"""`kvcellar cluster`: N `kvcellar serve` workers behind SMG, one process tree.

The gateway is SMG (the Shepherd Model Gateway, `smg` on PyPI, the
`kvcellar[cluster]` extra), a maintained router, not one of ours: it routes
plain OpenAI-compatible HTTP workers by a per-worker prefix tree
(`--policy cache_aware`), retries a request on another worker when one dies
and health-checks them back in. What it needs from a worker kvcellar already
serves: `GET /health` (200 while admitting), `GET /v1/models` (the model id
it groups workers by) and the APIs it forwards (docs/cluster.md).

Each worker gets its own SSD tier (`<ssd_root>/worker-<i>`: an SSD directory
is locked by one server) and all share one S3 tier, so a session the gateway
moves after a worker died restores its prefix from the shared tier instead of
recomputing it. Workers start first and the gateway only once every worker
answers `/health`: SMG registers what it can reach at start and would
otherwise wait its startup-check interval (30 s) before looking again.

Stopping (Ctrl-C, SIGTERM, `Cluster.stop`): the gateway first (no new
requests reach a worker), then every worker with SIGTERM, which drains and
flushes its SSD tier (`kvcellar serve`'s shutdown), each waited for within
`stop_timeout_s` and killed after it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import attrs

from kvcellar.errors import StopRequested, UsageError

GATEWAY_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "prefix_hash", "consistent_hashing")
HEALTH_POLL_S = 0.25


@attrs.frozen(kw_only=True)
class ClusterConfig:
    """What `kvcellar cluster` starts. `worker_ports` empty: free ports on `worker_host`."""

    model: str
    workers: int
    gateway_port: int
    ssd_root: Path
    shared_cache: str | None = None
    shared_cache_endpoint: str | None = None
    gateway_host: str = "127.0.0.1"
    worker_host: str = "127.0.0.1"
    worker_ports: tuple[int, ...] = ()
    policy: str = "cache_aware"
    serve_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 120.0

    def __attrs_post_init__(self) -> None:
        if self.workers < 1:
            raise UsageError("--workers must be at least 1")
        if self.worker_ports and len(self.worker_ports) != self.workers:
            raise UsageError(f"{len(self.worker_ports)} worker ports for {self.workers} workers")
        if self.policy not in GATEWAY_POLICIES:
            raise UsageError(f"--policy must be one of {', '.join(GATEWAY_POLICIES)}")


def smg_executable() -> str | None:
    """The `smg` command of this environment (beside the interpreter), else on PATH."""
    beside = Path(sys.executable).parent / "smg"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("smg")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def worker_command(config: ClusterConfig, index: int, port: int) -> list[str]:
    command = [sys.executable, "-m", "kvcellar.cli", "serve", "--model", config.model]
    command += ["--host", config.worker_host, "--port", str(port)]
    command += ["--ssd-cache", str(config.ssd_root / f"worker-{index}")]
    if config.shared_cache is not None:
        command += ["--shared-cache", config.shared_cache]
    if config.shared_cache_endpoint is not None:
        command += ["--shared-cache-endpoint", config.shared_cache_endpoint]
    return command + list(config.serve_args)


def gateway_command(config: ClusterConfig, smg: str, worker_urls: Sequence[str]) -> list[str]:
    # SMG's Prometheus listener defaults to 0.0.0.0:29000: a fixed port would make two
    # clusters on one machine collide, so it gets a free port beside the gateway's host.
    return [
        smg,
        "launch",
        "--worker-urls",
        *worker_urls,
        "--policy",
        config.policy,
        "--host",
        config.gateway_host,
        "--port",
        str(config.gateway_port),
        "--prometheus-host",
        config.gateway_host,
        "--prometheus-port",
        str(free_port(config.gateway_host)),
        "--log-level",
        "warn",
        *config.gateway_args,
    ]


@attrs.define
class Member:
    """One process of the tree: a worker (`index` >= 0) or the gateway (-1)."""

    name: str
    url: str
    command: list[str]
    process: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None

    def start(self, log_dir: Path | None) -> None:
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            self.log = (log_dir / f"{self.name}.log").open("ab")
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        # Its own process group: a Ctrl-C at the terminal reaches the launcher alone, which
        # then stops the members in order (gateway first) instead of all at once.
        self.process = subprocess.Popen(
            self.command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        if self.running:
            assert self.process is not None
            self.process.send_signal(signum)

    def wait(self, timeout_s: float) -> int | None:
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        finally:
            if self.log is not None:
                self.log.close()
                self.log = None


class Cluster:
    """The process tree: `start()`, then `stop()` (or `with cluster.running():`)."""

    def __init__(self, config: ClusterConfig) -> None:
        smg = smg_executable()
        if smg is None:
            raise UsageError("kvcellar cluster needs SMG's `smg` command: pip install 'kvcellar[cluster]'")
        self.config = config
        ports = config.worker_ports or tuple(free_port(config.worker_host) for _ in range(config.workers))
        self.workers = [
            Member(
                name=f"worker-{i}", url=f"http://{config.worker_host}:{port}", command=worker_command(config, i, port)
            )
            for i, port in enumerate(ports)
        ]
        urls = [worker.url for worker in self.workers]
        self.gateway = Member(
            name="gateway",
            url=f"http://{config.gateway_host}:{config.gateway_port}",
            command=gateway_command(config, smg, urls),
        )

    def start(self) -> None:
        """Every worker, healthy, then the gateway, serving the model; stops what started on failure."""
        try:
            for worker in self.workers:
                worker.start(self.config.log_dir)
            deadline = time.monotonic() + self.config.startup_timeout_s
            for worker in self.workers:
                self._wait_for(worker, "/health", deadline)
            self.gateway.start(self.config.log_dir)
            self._wait_for(self.gateway, "/v1/models", deadline)
        except BaseException:
            self.stop()
            raise

    def start_worker(self, index: int) -> None:
        """(Re)start one worker on its port and SSD directory; returns once it is healthy."""
        worker = self.workers[index]
        worker.start(self.config.log_dir)
        self._wait_for(worker, "/health", time.monotonic() + self.config.startup_timeout_s)

    def kill_worker(self, index: int) -> None:
        """SIGKILL one worker (no drain, no flush): what failover is tested against."""
        worker = self.workers[index]
        worker.signal(signal.SIGKILL)
        worker.wait(self.config.stop_timeout_s)

    def stop(self) -> dict[str, int | None]:
        """Gateway first, then the workers with SIGTERM (each drains and flushes); exit statuses by name."""
        self.gateway.signal(signal.SIGTERM)
        statuses = {self.gateway.name: self.gateway.wait(self.config.stop_timeout_s)}
        for worker in self.workers:
            worker.signal(signal.SIGTERM)
        for worker in self.workers:
            statuses[worker.name] = worker.wait(self.config.stop_timeout_s)
        return statuses

    @contextmanager
    def running(self) -> Iterator[Cluster]:
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def first_exited(self) -> Member | None:
        """A member that exited by itself, if any (the launcher then stops the rest)."""
        return next((m for m in (self.gateway, *self.workers) if m.process is not None and not m.running), None)

    def _wait_for(self, member: Member, path: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not member.running:
                raise UsageError(f"{member.name} exited at start (status {_status(member)}); see its log")
            if _answers(member.url + path):
                return
            time.sleep(HEALTH_POLL_S)
        raise UsageError(f"{member.name} at {member.url} did not answer {path} within the startup timeout")


def _answers(url: str) -> bool:
    """GET `url` answers 200 (urllib: the launcher needs no HTTP client beyond the standard library)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _status(member: Member) -> int | None:
    return member.process.poll() if member.process is not None else None


def run_cluster(config: ClusterConfig, announce: IO[str]) -> int:
    """`kvcellar cluster`: start, serve until Ctrl-C/SIGTERM or a member exits, stop; the exit status."""
    stopping: list[int] = []
    started = False

    def request_stop(signum: int, _frame: object) -> None:
        stopping.append(signum)
        if not started:
            # During start-up: unwind `Cluster.start`, which stops what it had started.
            raise StopRequested(signum)

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    cluster = Cluster(config)
    try:
        try:
            cluster.start()
        except StopRequested:
            return 0
        started = True
        print(f"gateway {cluster.gateway.url} ({config.policy}) over", *(w.url for w in cluster.workers), file=announce)
        announce.flush()
        while not stopping and cluster.first_exited() is None:
            time.sleep(HEALTH_POLL_S)
        exited = cluster.first_exited()
        statuses = cluster.stop()
        print("stopped:", ", ".join(f"{name} {status}" for name, status in statuses.items()), file=announce)
        return 1 if exited is not None and not stopping else 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
