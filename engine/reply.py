"""`Reply[T]`: the one answer to one request, and its cross-thread twin.

Every request/response pair in kvcellar (an engine job's result, a gateway
step's result, an admission decision, a drain or idle wait, a spill's outcome,
a flush verdict) is a `Reply`: a `trio.Event` and an `outcome.Outcome`. The
side that answers calls `set`, `fail` or `settle` once, on the Trio thread;
the one task that asked awaits `wait()`, which returns the value or raises the
error. An outcome unwraps once (`outcome.AlreadyUsedError` otherwise): a reply
has one reader.

`CrossThreadReply` is answered from another thread (the engine thread) and
awaited on Trio. It remembers the Trio token of the thread that made it, and
`settle_from_thread` hands the outcome over with `run_sync_soon`, so the
outcome is stored and the event set on the Trio thread: the reply has one
owner, no lock and no `threading.Event`, and the Trio side never blocks.

It lives in `engine/` because the engine is the lowest layer that runs Trio
(the engine thread answers `EngineThread.call` with it); the actors take it
from `kvcellar.actors.runtime`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import outcome
import trio

T = TypeVar("T")


class Reply(Generic[T]):
    """A one-shot answer, set on the Trio thread. Setting it twice is a bug
    (`RuntimeError`)."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self._outcome: outcome.Outcome[T] | None = None

    @property
    def is_set(self) -> bool:
        return self._outcome is not None

    def set(self, value: T) -> None:
        self.settle(outcome.Value(value))

    def fail(self, error: BaseException) -> None:
        self.settle(outcome.Error(error))

    def settle(self, result: outcome.Outcome[T]) -> None:
        if self._outcome is not None:
            raise RuntimeError(f"a reply is answered once: already {self._outcome!r}, then {result!r}")
        self._outcome = result
        self._event.set()

    async def settled(self) -> None:
        """Return once the answer is there (a checkpoint, like `trio.Event.wait`)."""
        await self._event.wait()

    def result(self) -> T:
        """The answer's value, or its error raised; only once it is set."""
        if self._outcome is None:
            raise RuntimeError("the reply has not been answered yet")
        return self._outcome.unwrap()

    async def wait(self) -> T:
        """Wait for the answer: its value, or its error raised."""
        await self._event.wait()
        return self.result()


class CrossThreadReply(Reply[T]):
    """A `Reply` answered from another thread: make it on the Trio thread,
    answer it with `settle_from_thread` or `capture_from_thread` anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self._token = trio.lowlevel.current_trio_token()

    def settle_from_thread(self, result: outcome.Outcome[T]) -> None:
        self._token.run_sync_soon(self.settle, result)

    def capture_from_thread(self, fn: Callable[..., T], *args: Any) -> None:
        """Run `fn(*args)` here (this thread) and answer with its result or
        whatever it raised (any `BaseException`: the caller gets it)."""
        self.settle_from_thread(outcome.capture(fn, *args))
