"""One transition table per actor core: `(state, message type) -> (targets,
handler)`, looked up before the handler runs (after h11's `_state.py`).

A core's `handle(msg, now)` is `TABLE.fire(self, msg, now)`. `fire` looks the
pair up first: a message the table does not take in the core's state raises
`IllegalTransition` naming the actor, the state and the message, before
anything changes. The handler then checks what it must of the message (an id
it does not hold, a stale answer) before its first assignment, and returns
the next state with the effects; no handler sets the state itself. The table
lists, per row, every state the handler may leave the core in; a handler that
picks another is a bug in the core (an `AssertionError`, never a protocol
error), which the hypothesis tests of each core would find.

Trio-free and MLX-free, like the cores that use it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import attrs

from kvcellar.errors import IllegalTransition

S = TypeVar("S", bound=enum.Enum)

# A handler: (core, message, now) -> (next state, effects).
Handler = Callable[[Any, Any, float], tuple[Any, list[Any]]]


class Stateful(Protocol):
    state: Any


@attrs.frozen(kw_only=True)
class Transition(Generic[S]):
    """One row's outcome: the handler and the states it may leave the core in."""

    handler: Handler
    targets: frozenset[S]


# `rows(..., to=SAME)`: each state's row leaves the core in that state.
SAME: frozenset[Any] = frozenset()


def rows(
    states: Iterable[S], message_types: Iterable[type], handler: Handler, to: Iterable[S] = SAME
) -> dict[tuple[S, type], Transition[S]]:
    """The rows taking each of `message_types` in each of `states` to `handler`,
    which may leave the core in any state of `to` (or, with `SAME`, only in
    the state it was in)."""
    targets = frozenset(to)
    return {
        (state, message_type): Transition(handler=handler, targets=targets or frozenset({state}))
        for state in states
        for message_type in message_types
    }


class TransitionTable(Generic[S]):
    """An actor's one table; `actor` names it in errors ("the spill queue")."""

    def __init__(self, actor: str, table: Mapping[tuple[S, type], Transition[S]]) -> None:
        self.actor = actor
        self._table = dict(table)

    def lookup(self, state: S, msg: object) -> Transition[S]:
        """The row for `msg` in `state`; `IllegalTransition` when there is none."""
        transition = self._table.get((state, type(msg)))
        if transition is None:
            raise IllegalTransition(f"{self.actor} cannot take {type(msg).__name__} in state {state.name}")
        return transition

    def fire(self, core: Stateful, msg: object, now: float) -> list[Any]:
        """Look the row up, run its handler, then set the state it chose."""
        transition = self.lookup(core.state, msg)
        next_state, effects = transition.handler(core, msg, now)
        if next_state not in transition.targets:
            raise AssertionError(
                f"{self.actor}: the handler of {type(msg).__name__} in state {core.state.name} "
                f"chose {next_state.name}, which its row does not list"
            )
        core.state = next_state
        return effects

    def accepts(self, state: S) -> frozenset[type]:
        """The message types `state` takes (documentation and tests)."""
        return frozenset(message_type for (row_state, message_type) in self._table if row_state is state)

    def targets(self) -> dict[S, frozenset[S]]:
        """Every state each state may move to, over all its rows."""
        moves: dict[S, set[S]] = {}
        for (state, _), transition in self._table.items():
            moves.setdefault(state, set()).update(transition.targets)
        return {state: frozenset(to) for state, to in moves.items()}
