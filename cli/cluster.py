"""`kvcellar cluster`: N workers and the SMG gateway as one process tree (`kvcellar.http.cluster`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvcellar.http.cluster import GATEWAY_POLICIES, ClusterConfig, run_cluster


@click.command("cluster")
@click.option("--model", required=True, help="The model every worker serves (a directory or a hub id).")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True, help="How many workers.")
@click.option("--shared-cache", "shared_cache", default=None, help="s3://BUCKET/PREFIX: the tier every worker shares.")
@click.option("--shared-cache-endpoint", default=None, help="The S3 endpoint URL (MinIO, R2, a local server).")
@click.option(
    "--gateway-port",
    type=click.IntRange(1, 65535),
    default=30000,
    show_default=True,
    help="The port the SMG gateway listens on: point clients here.",
)
@click.option("--gateway-host", default="127.0.0.1", show_default=True, help="Where the gateway listens.")
@click.option("--worker-host", default="127.0.0.1", show_default=True, help="Where the workers listen.")
@click.option(
    "--worker-port",
    "worker_ports",
    type=click.IntRange(1, 65535),
    multiple=True,
    help="One per worker, in order (default: free ports).",
)
@click.option(
    "--policy",
    type=click.Choice(GATEWAY_POLICIES),
    default="cache_aware",
    show_default=True,
    help="SMG's routing policy: cache_aware keeps a conversation on the worker that holds its prefix.",
)
@click.option(
    "--ssd-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".kvcellar-cluster"),
    show_default=True,
    help="Each worker's SSD tier is <ssd-root>/worker-<i>.",
)
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Logs per process.")
@click.option("--serve-arg", "serve_args", multiple=True, help="One more `kvcellar serve` argument per worker.")
@click.option("--gateway-arg", "gateway_args", multiple=True, help="One more `smg launch` argument.")
def cluster_command(
    model: str,
    workers: int,
    shared_cache: str | None,
    shared_cache_endpoint: str | None,
    gateway_port: int,
    gateway_host: str,
    worker_host: str,
    worker_ports: tuple[int, ...],
    policy: str,
    ssd_root: Path,
    log_dir: Path | None,
    serve_args: tuple[str, ...],
    gateway_args: tuple[str, ...],
) -> None:
    """Start N `kvcellar serve` workers behind SMG (`pip install 'kvcellar[cluster]'`); Ctrl-C stops all.

    Each worker has its own SSD tier and, with --shared-cache, all share one S3 tier: a session the
    gateway moves off a dead worker restores from it. See docs/cluster.md.
    """
    config = ClusterConfig(
        model=model,
        workers=workers,
        gateway_port=gateway_port,
        ssd_root=ssd_root,
        shared_cache=shared_cache,
        shared_cache_endpoint=shared_cache_endpoint,
        gateway_host=gateway_host,
        worker_host=worker_host,
        worker_ports=worker_ports,
        policy=policy,
        serve_args=serve_args,
        gateway_args=gateway_args,
        log_dir=log_dir,
    )
    sys.exit(run_cluster(config, sys.stdout))
