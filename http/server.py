"""`kvcellar serve`: the actor system and hypercorn in one `trio.run` and one nursery.

Shutdown on SIGINT/SIGTERM: stop admission (new requests get 503), drain
active requests, run the same flush as `POST /admin/cache/flush` bounded by
`KVCELLAR_SHUTDOWN_TIMEOUT_S` (default 120), log the verdict (a WARNING counts
the prefixes not made durable, whose queued spills are dropped), stop serving.
"""

from __future__ import annotations

import logging
import signal
from functools import partial
from typing import TYPE_CHECKING, cast

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from kvcellar.actors.model_pool import ModelPool
from kvcellar.actors.system import System, SystemConfig, open_system
from kvcellar.http.app import HttpSettings, build_app

if TYPE_CHECKING:
    from hypercorn.typing import ASGIFramework

log = logging.getLogger("kvcellar.serve")


def banner(system: System, host: str, port: int) -> str:
    """One block naming the model, the URL, the tiers and what was restored."""
    stats = system.stats()
    ram_gb = system.prompt_cache.bytes_max / 1e9
    lines = [
        f"kvcellar serving {system.loaded.model_dir} on http://{host}:{port}",
        f"  RAM prompt cache: {'off' if ram_gb <= 0 else f'{ram_gb:g} GB'}; KV scheme {system.scheme.cache_key}",
    ]
    lane = stats["scheduler"]
    if lane["lane"] == "batch":
        lines.append(f"  batch lane: up to {lane['batch_size']} rows, KV budget {lane['kv_budget_bytes'] / 1e9:g} GB")
    else:
        lines.append(f"  serial lane: {lane['reason']}")
    if system.store is not None:
        ssd = stats["ssd_cache"]
        cap = "unlimited" if not ssd["max_bytes"] else f"{ssd['max_bytes'] / 1e9:g} GB"
        lines.append(
            f"  SSD cache: {system.store.directory} ({cap}); restored index: {ssd['entries']} entries, "
            f"{ssd['bytes'] / 1e6:.1f} MB, longest prefix {ssd['longest_durable_prefix_tokens']} tokens"
        )
    else:
        lines.append("  SSD cache: off (use --ssd-cache DIR to keep prefixes across restarts)")
    lines.append(memory_banner_line(stats["memory"]))
    return "\n".join(lines)


def memory_banner_line(memory: dict) -> str:
    """The memory guard's budget and the headroom the weights leave."""
    if not memory["budget_bytes"]:
        return "  memory budget: off (--memory-budget 0)"
    return (
        f"  memory budget: {memory['budget_bytes'] / 1e9:.3g} GB live MLX memory, "
        f"{memory['headroom_bytes'] / 1e9:.3g} GB headroom after {memory['weights_bytes'] / 1e9:.3g} GB of weights"
    )


async def serve_forever(
    config: SystemConfig, host: str, port: int, settings: HttpSettings, *, ready: trio.Event | None = None
) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully."""
    async with open_system(config) as system:
        hypercorn_config = Config()
        hypercorn_config.bind = [f"{host}:{port}"]
        hypercorn_config.accesslog = None
        # A logger (not a stream) makes hypercorn log through the root logger, once, in our format.
        hypercorn_config.errorlog = logging.getLogger("hypercorn.error")
        stop_serving = trio.Event()

        async def shutdown_trigger() -> None:
            await stop_serving.wait()

        async with trio.open_nursery() as nursery:
            # Starlette is an ASGI 3 app; hypercorn's stub spells the ASGI callable
            # with its own event types, which Starlette's annotations do not name.
            app = cast("ASGIFramework", build_app(system, settings))
            await nursery.start(partial(serve, app, hypercorn_config, shutdown_trigger=shutdown_trigger))
            log.info("%s", banner(system, host, port))
            if ready is not None:
                ready.set()
            await _wait_for_signal()
            log.info("shutting down: admission stopped, draining and flushing")
            # Always a verdict (reason "timeout" past the bound); the system
            # has already warned about anything it could not make durable.
            verdict = await system.shutdown()
            log.info("shutdown flush: %s", attrs.asdict(verdict) if verdict is not None else "cancelled")
            stop_serving.set()


async def _wait_for_signal() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


async def serve_pool_forever(
    pool: ModelPool, host: str, port: int, settings: HttpSettings, *, ready: trio.Event | None = None
) -> None:
    """A model pool (http/pool_app.py) until SIGINT/SIGTERM; then every loaded model shuts down as one server does."""
    from kvcellar.http.pool_app import PoolApp

    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        try:
            await pool.start_pinned()
            hypercorn_config = Config()
            hypercorn_config.bind = [f"{host}:{port}"]
            hypercorn_config.accesslog = None
            hypercorn_config.errorlog = logging.getLogger("hypercorn.error")
            stop_serving = trio.Event()

            async def shutdown_trigger() -> None:
                await stop_serving.wait()

            async with trio.open_nursery() as http_nursery:
                app = cast("ASGIFramework", PoolApp(pool, settings))
                await http_nursery.start(partial(serve, app, hypercorn_config, shutdown_trigger=shutdown_trigger))
                log.info("kvcellar serving a model pool on http://%s:%d: %s", host, port, pool_banner(pool))
                if ready is not None:
                    ready.set()
                await _wait_for_signal()
                log.info("shutting down: every loaded model drains and flushes")
                await pool.shutdown()
                stop_serving.set()
        finally:
            nursery.cancel_scope.cancel()


def pool_banner(pool: ModelPool) -> str:
    models = ", ".join(
        f"{spec.name} ({spec.source}{', pinned' if spec.pin else ''}"
        f"{', aliases ' + ' '.join(spec.aliases) if spec.aliases else ''})"
        for spec in pool.names.models
    )
    budget = "no limit" if pool.budget_bytes <= 0 else f"{pool.budget_bytes / 1e9:.3g} GB"
    return f"{models}; weights budget {budget}; default model {pool.names.default or '(none: unknown names are 404s)'}"
