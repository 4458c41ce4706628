"""Deliberate durability bugs, switched on only by `kvcellar simulate --mutate`.

Each name turns one safeguard of the store off, so the simulator's sweep can
prove that its invariant checkers notice the loss (a checker that never fails
proves nothing). Serving never enables them; the switch is process-wide
because the store's write and read paths have no other channel to the
simulator, and `enabled()` restores the previous set on exit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from kvcellar.errors import UsageError

MUTATIONS = {
    "skip-file-fsync": "commit renames the entry file without fsyncing its data",
    "skip-dir-fsync": "commit does not fsync the directory after the rename",
    "trust-failed-fsync": "a failed fsync of an entry file is ignored and the write reported stored",
    "skip-header-check": "restore and the startup scan trust every byte they read (no checksums)",
    "ack-before-rename": "a write is reported stored before its file is renamed into place",
    "skip-startup-supersession": "startup does not redo a supersession whose unlink a power loss undid",
    "restore-holds-index-lock": "a restore reads its file while holding the store's index lock (the Trio thread's "
                                "find, covers and stats then wait on disk)",
    "journal-unowned-append": "a journal append runs its transaction on the caller's thread instead of the "
                              "journal's owner (the shared-connection race)",
}

_active: frozenset[str] = frozenset()


def active(name: str) -> bool:
    """Whether the deliberate bug `name` is switched on."""
    return name in _active


@contextmanager
def enabled(names: Iterable[str]) -> Iterator[None]:
    """Switch the named bugs on for the duration; raises `UsageError` for an unknown name."""
    global _active
    wanted = frozenset(names)
    unknown = sorted(wanted - MUTATIONS.keys())
    if unknown:
        raise UsageError(f"unknown mutation {', '.join(unknown)}; choose from {', '.join(MUTATIONS)}")
    previous, _active = _active, wanted
    try:
        yield
    finally:
        _active = previous
