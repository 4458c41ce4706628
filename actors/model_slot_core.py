"""One model of the pool, its lifecycle as a sans-IO core (issue 41; the shell is actors/model_pool.py).

    UNLOADED --LoadBegun--> LOADING --Loaded--> LOADED --DrainBegun--> DRAINING --Unloaded--> UNLOADED
                               |                  |                        |
                               +--LoadFailed--> FAILED <--ServingFailed----+   DRAINING --DrainRefused--> LOADED
    (ServingFailed: the model's System failed past its start, from LOADING, LOADED or DRAINING)
    FAILED --LoadBegun--> LOADING (a later request tries again)

The one table is looked up before anything changes: a message the state does not take raises
`IllegalTransition` and leaves the core as it was. The core keeps the counters `/stats` shows.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from kvcellar.actors.transitions import TransitionTable, rows


class SlotState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    DRAINING = "draining"
    FAILED = "failed"


@attrs.frozen(kw_only=True)
class LoadBegun:
    pass


@attrs.frozen(kw_only=True)
class Loaded:
    load_s: float


@attrs.frozen(kw_only=True)
class LoadFailed:
    error: str


@attrs.frozen(kw_only=True)
class DrainBegun:
    pass


@attrs.frozen(kw_only=True)
class DrainRefused:
    reason: str


@attrs.frozen(kw_only=True)
class Unloaded:
    pass


@attrs.frozen(kw_only=True)
class ServingFailed:
    error: str


SlotMessage = LoadBegun | Loaded | LoadFailed | DrainBegun | DrainRefused | Unloaded | ServingFailed


@attrs.define(kw_only=True)
class SlotCore:
    state: SlotState = SlotState.UNLOADED
    loads: int = 0
    unloads: int = 0
    load_s_last: float | None = None
    loading_since_s: float | None = None
    error: str = ""

    def handle(self, msg: SlotMessage, now: float) -> list[Any]:
        return SLOT_TABLE.fire(self, msg, now)

    def _begin_load(self, _: LoadBegun, now: float) -> tuple[SlotState, list[Any]]:
        self.loading_since_s, self.error = now, ""
        return SlotState.LOADING, []

    def _loaded(self, msg: Loaded, _: float) -> tuple[SlotState, list[Any]]:
        self.loads, self.load_s_last, self.loading_since_s = self.loads + 1, msg.load_s, None
        return SlotState.LOADED, []

    def _failed(self, msg: LoadFailed | ServingFailed, _: float) -> tuple[SlotState, list[Any]]:
        self.error, self.loading_since_s = msg.error, None
        return SlotState.FAILED, []

    def _drain(self, _: DrainBegun, __: float) -> tuple[SlotState, list[Any]]:
        return SlotState.DRAINING, []

    def _drain_refused(self, _: DrainRefused, __: float) -> tuple[SlotState, list[Any]]:
        return SlotState.LOADED, []

    def _unloaded(self, _: Unloaded, __: float) -> tuple[SlotState, list[Any]]:
        self.unloads += 1
        return SlotState.UNLOADED, []


SLOT_TABLE: TransitionTable[SlotState] = TransitionTable(
    "a model slot",
    {
        **rows([SlotState.UNLOADED, SlotState.FAILED], [LoadBegun], SlotCore._begin_load, to=[SlotState.LOADING]),
        **rows([SlotState.LOADING], [Loaded], SlotCore._loaded, to=[SlotState.LOADED]),
        **rows([SlotState.LOADING], [LoadFailed], SlotCore._failed, to=[SlotState.FAILED]),
        **rows([SlotState.LOADED], [DrainBegun], SlotCore._drain, to=[SlotState.DRAINING]),
        **rows([SlotState.DRAINING], [DrainRefused], SlotCore._drain_refused, to=[SlotState.LOADED]),
        **rows([SlotState.DRAINING], [Unloaded], SlotCore._unloaded, to=[SlotState.UNLOADED]),
        **rows(
            [SlotState.LOADING, SlotState.LOADED, SlotState.DRAINING],
            [ServingFailed],
            SlotCore._failed,
            to=[SlotState.FAILED],
        ),
    },
)
