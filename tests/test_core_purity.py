"""Every actor core is pure: its module, imported alone in a fresh
interpreter, loads neither Trio nor MLX nor any actor shell. And every core
decides its transitions by one table, looked up before anything changes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcellar.actors import admission_core, durability_core, gateway_core, scheduler_core, ssd_writer_core
from kvcellar.actors.checkpoint_queue_core import CheckpointQueueCore
from kvcellar.actors.queue_core import QueueState
from kvcellar.actors.spill_queue_core import SpillQueueCore
from kvcellar.actors.transitions import TransitionTable
from kvcellar.errors import IllegalTransition

CORE_MODULES = (
    "kvcellar.actors.gateway_core",
    "kvcellar.actors.scheduler_core",
    "kvcellar.actors.queue_core",
    "kvcellar.actors.spill_queue_core",
    "kvcellar.actors.checkpoint_queue_core",
    "kvcellar.actors.ssd_writer_core",
    "kvcellar.actors.durability_core",
    "kvcellar.actors.admission_core",
    "kvcellar.actors.model_slot_core",
    "kvcellar.actors.model_names",
    "kvcellar.actors.model_pool_plan",
    "kvcellar.actors.transitions",
    "kvcellar.actors.effects",
)
# The shells and the runtime: a core that loads one of them is not pure.
SHELL_MODULES = (
    "kvcellar.actors.runtime",
    "kvcellar.actors.gateway",
    "kvcellar.actors.scheduler",
    "kvcellar.actors.spill_queue",
    "kvcellar.actors.checkpoint_writer",
    "kvcellar.actors.ssd_writer",
    "kvcellar.actors.durability_shell",
    "kvcellar.actors.admission",
    "kvcellar.actors.system",
)
FORBIDDEN_PREFIXES = ("trio", "mlx", "mlx_lm", "outcome", *SHELL_MODULES)

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


def _loaded_by(module: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, module], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(result.stdout)


@pytest.mark.parametrize("module", CORE_MODULES)
def test_a_core_module_loads_no_trio_mlx_or_shell(module: str) -> None:
    loaded = _loaded_by(module)
    offenders = [name for name in loaded for bad in FORBIDDEN_PREFIXES if name == bad or name.startswith(bad + ".")]
    assert not offenders, f"{module} loads {offenders}"


def test_the_probe_sees_a_shell_load_trio() -> None:
    # The check above would pass vacuously if the probe saw nothing.
    assert "trio" in _loaded_by("kvcellar.actors.spill_queue")


TABLES = {
    "gateway": (gateway_core.GATEWAY_TABLE, gateway_core.GatewayCore()),
    "scheduler": (scheduler_core.SCHEDULER_TABLE, scheduler_core.SchedulerCore(rows_max=2, kv_budget_bytes=100)),
    "ssd writer": (ssd_writer_core.SSD_WRITER_TABLE, ssd_writer_core.SsdWriterCore()),
    "durability": (durability_core.DURABILITY_TABLE, durability_core.DurabilityCore()),
    "admission": (admission_core.ADMISSION_TABLE, admission_core.AdmissionCore()),
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_core_handles_through_its_table(name: str) -> None:
    table, core = TABLES[name]
    assert isinstance(table, TransitionTable)
    # Every state the table names is one of the core's states, and every state has a row.
    states = type(core.state)
    assert set(table.targets()) == set(states)
    for targets in table.targets().values():
        assert targets <= set(states)


@pytest.mark.parametrize("core", [SpillQueueCore(10), CheckpointQueueCore(10)], ids=["spill queue", "checkpoint queue"])
def test_both_queues_are_the_one_queue_core(core: SpillQueueCore | CheckpointQueueCore) -> None:
    assert type(core).handle is SpillQueueCore.handle is CheckpointQueueCore.handle
    assert core.state is QueueState.IDLE


class Unknown:
    """A message no table takes."""


@pytest.mark.parametrize(
    "core",
    [
        gateway_core.GatewayCore(),
        scheduler_core.SchedulerCore(rows_max=1, kv_budget_bytes=1),
        ssd_writer_core.SsdWriterCore(),
        durability_core.DurabilityCore(),
        admission_core.AdmissionCore(),
        SpillQueueCore(10),
        CheckpointQueueCore(10),
    ],
    ids=lambda core: type(core).__name__,
)
def test_a_message_the_table_does_not_take_names_the_state_and_the_message(core: object) -> None:
    before = vars(core).copy()
    with pytest.raises(IllegalTransition) as raised:
        core.handle(Unknown(), 0.0)  # type: ignore[attr-defined]
    message = str(raised.value)
    assert "Unknown" in message and core.state.name in message  # type: ignore[attr-defined]
    assert vars(core) == before
