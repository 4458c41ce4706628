"""`kvcellar serve`: the engine thread and hypercorn in one `trio.run` and one nursery."""

from __future__ import annotations

import logging
import signal
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from kvcellar.engine.engine import EngineThread

log = logging.getLogger("kvcellar.serve")


async def serve_forever(model_dir: Path, host: str, port: int, *, ready: trio.Event | None = None,
                        stop: trio.Event | None = None) -> None:
    """Load the model on the engine thread, then serve until SIGINT/SIGTERM
    (or until `stop` is set, for tests)."""
    from kvcellar.http.app import build_app

    engine = EngineThread(model_dir)
    loaded = await engine.start()
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    stop = stop or trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signals, stop)
            await nursery.start(partial(serve, build_app(engine, loaded), config, shutdown_trigger=_shutdown_trigger(stop)))
            log.info("serving %s on http://%s:%d", loaded.model_dir, host, port)
            if ready is not None:
                ready.set()
            await stop.wait()
            nursery.cancel_scope.deadline = trio.current_time() + 10
    finally:
        engine.stop()


def _shutdown_trigger(stop: trio.Event):
    async def trigger() -> None:
        await stop.wait()

    return trigger


async def _stop_on_signals(stop: trio.Event) -> None:
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                log.info("shutting down")
                stop.set()
                return
    except RuntimeError:
        # Signal handlers can only be installed from the main thread (tests run elsewhere).
        await trio.sleep_forever()
