"""SSD write admission on the Trio thread: `AdmissionGate`, the face of the
pure `AdmissionCore` (`actors/admission_core.py`, where the policies are
described). The spill queue's one entrance (`SpillQueue.submit`,
`submit_nowait`) asks it for every background write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcellar.actors.admission_core import (
    AdmissionCore,
    AdmissionMessage,
    Candidate,
    PrefillMeasured,
    Put,
    Reconsider,
    Taken,
)
from kvcellar.actors.durability_core import RecordKey
from kvcellar.store.prompt_cache import SpillSnapshot


class AdmissionGate:
    """The Trio-thread face of `AdmissionCore` (no awaits, no I/O): the RAM
    tier's takes and puts arrive here through its events port (`WriteBehind`),
    the spill queue's one entrance asks it, and each `Reconsider` goes to
    `on_granted` (through `WriteBehind`, the coordinator's `admission_granted`)."""

    def __init__(
        self, core: AdmissionCore, *, clock_s: Callable[[], float], on_granted: Callable[[RecordKey], None]
    ) -> None:
        self.core = core
        self._clock_s = clock_s
        self._on_granted = on_granted

    @property
    def measures_prefill(self) -> bool:
        return self.core.policy == "cost"

    def taken(self, namespace: str, tokens: tuple[int, ...]) -> None:
        self._observe(Taken(namespace=namespace, tokens=tokens))

    def put(self, namespace: str, tokens: tuple[int, ...]) -> None:
        self._observe(Put(namespace=namespace, tokens=tokens))

    def prefill_measured(self, tokens: int, seconds: float) -> None:
        self._observe(PrefillMeasured(tokens=tokens, seconds=seconds))

    def _observe(self, msg: AdmissionMessage) -> None:
        for effect in self.core.handle(msg, self._clock_s()):
            if isinstance(effect, Reconsider):
                self._on_granted(effect.key)

    def admits(self, snapshot: SpillSnapshot, *, forced: bool, covered: bool = False) -> bool:
        """Whether the spill queue may take `snapshot` (a write-behind snapshot
        or a spill leaving RAM); a refusal is remembered as held or skipped.
        The spill queue's one entrance is the only caller."""
        candidate = Candidate(
            namespace=snapshot.namespace,
            tokens=snapshot.tokens,
            bytes=snapshot.bytes,
            kind=snapshot.reason,
            forced=forced,
            covered=covered,
        )
        return self.core.decide(candidate).admit

    def was_skipped(self, key: RecordKey) -> bool:
        return self.core.was_skipped(key)

    def stats(self) -> dict[str, Any]:
        return self.core.stats()
