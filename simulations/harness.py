"""One deterministic simulated run: the real system on `SimDisk`, a workload,
crashes, recovery, invariants.

Determinism: one `trio.run` per run under `MockClock(autojump_threshold=0)`
with Trio's scheduler seeded; no threads (the `InlineEngine`, blocking I/O
run inline); every random choice comes from `random.Random` objects derived
from the seed. The lane comes from its own stream (`lane_for_seed`): about
half the seeds run every request through the batch lane (the Scheduler and
`BatchLoop` over mlx-lm's `BatchGenerator`, 2-4 rows, sometimes a KV budget
small enough to make rows wait), the rest through the serial lane. The
journal is an in-memory SQLite database whose durable image is taken at each
commit (`JournalImage`), so a crash keeps exactly the committed transactions
and `journal_digest` is reproducible byte for byte.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import sqlite3
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing

from kvcellar.actors.scheduler_core import KV_BUDGET_BYTES_DEFAULT
from kvcellar.actors.system import SystemConfig, SystemSeams, open_system
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest, TokenDelta
from kvcellar.errors import KvCellarError
from kvcellar.simulations import determinism
from kvcellar.simulations.boundary import BoundaryChecks, BoundarySchedule, SeededBlocking
from kvcellar.simulations.fake_engine import FakeModel, InlineEngine, fake_drafter, fake_loaded_model, next_token
from kvcellar.simulations.observer import Observer
from kvcellar.simulations.sim_disk import FaultConfig, SimDisk, SimulatedCrash
from kvcellar.simulations.workload import (
    Burst,
    Crash,
    Flush,
    Fork,
    Idle,
    Request,
    Restart,
    Step,
    Wipe,
    WorkloadShape,
    build_workload,
    system_prompt,
)
from kvcellar.store import mutations
from kvcellar.store.journal import Journal, decode_event
from kvcellar.store.safeguards import Safeguards
from kvcellar.store.ssd import IndexedEntry, SsdStore
from kvcellar.store.wipe import WipeSelector

SIM_ROOT = PurePosixPath("/sim")
CACHE_DIR = Path("/sim/cache")
FINGERPRINT = "sim-fingerprint"
EPOCH_NS = 1_800_000_000 * 10**9
LIVENESS_FLUSHES = 3
BATCH_LANE_RATE = 0.5
BATCH_ROWS = (2, 4)
# The fake model's KV costs 128 B a token: 24 KiB holds one or two rows of a
# grown conversation, so a burst's later rows wait for an earlier one to end.
KV_BUDGETS_BYTES = (KV_BUDGET_BYTES_DEFAULT, 64 * 1024, 24 * 1024)

FAULTS = {
    "fsync": FaultConfig(fsync_eio_rate=0.08),
    "enospc": FaultConfig(write_enospc_rate=0.02),
    "eio": FaultConfig(write_eio_rate=0.02),
    "bitflip": FaultConfig(read_bitflip_rate=0.02),
    "misdirect": FaultConfig(misdirected_write_rate=0.02),
}


def combined_faults(names: frozenset[str]) -> FaultConfig:
    config = FaultConfig()
    for name in sorted(names):
        config = attrs.evolve(config, **{k: v for k, v in attrs.asdict(FAULTS[name]).items() if v})
    return config


@attrs.frozen(kw_only=True)
class Lane:
    """Rows of the batch lane (1: the serial lane) and its KV budget."""

    rows: int
    kv_budget_bytes: int


def lane_for_seed(seed: int, batch_rows: int | None = None) -> Lane:
    """The seed's lane, from a stream of its own (so drawing it moves no other
    choice); `batch_rows` forces the rows and keeps the seed's budget."""
    rng = random.Random(f"lane-{seed}")
    batched = rng.random() < BATCH_LANE_RATE
    rows = rng.randint(*BATCH_ROWS)
    kv_budget_bytes = rng.choice(KV_BUDGETS_BYTES)
    if batch_rows is not None:
        rows = batch_rows
    elif not batched:
        rows = 1
    return Lane(rows=rows, kv_budget_bytes=kv_budget_bytes)


@attrs.frozen(kw_only=True)
class RunOptions:
    """`batch_rows`: None draws the lane from the seed; 1 forces the serial lane."""

    seed: int
    shape: WorkloadShape = attrs.field(factory=WorkloadShape)
    faults: frozenset[str] = frozenset()
    crash_at_op: int | None = None
    real_model_dir: Path | None = None
    mutations: frozenset[str] = frozenset()
    prompt_cache_bytes: int = 96 * 1024
    ssd_bytes_max: int = 1536 * 1024
    batch_rows: int | None = None


@attrs.define(kw_only=True)
class RunResult:
    seed: int
    violations: list[Any]
    journal_digest: str
    disk_digest: str
    disk_ops: int
    workload_ops: int
    crashes: int
    restarts: int
    requests: int
    flushes: int
    durable_flushes: int
    claims_checked: int
    sim_time_s: float
    batch_rows: int = 1
    # Decode steps of the batch lane by how many rows shared them.
    decode_steps_by_rows: dict[int, int] = attrs.Factory(dict)
    journal_kinds: dict[str, int] = attrs.Factory(dict)
    # Generations the checkpoints workload resumed from a checkpoint.
    checkpoint_resumes: int = 0
    kept_disk: Any = attrs.field(default=None, repr=False)
    kept_journal: bytes | None = attrs.field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return not self.violations


class JournalImage:
    """The journal's durable state: the database image after its last commit.
    Each transaction is a disk operation of the simulation (a crash point)."""

    def __init__(self, disk: SimDisk, follow: Callable[[Any], None], on_transaction: Callable[[], None]) -> None:
        self.disk = disk
        self._on_transaction = on_transaction
        self.durable: bytes | None = None
        self.commits = 0
        self._follow = follow
        self.followed_seq = 0
        self.kinds: Counter[str] = Counter()

    def image(self) -> bytes | None:
        return self.durable

    def before_transaction(self) -> None:
        self._on_transaction()
        self.disk.crash_point("journal commit")

    def committed(self, connection: sqlite3.Connection) -> None:
        self.durable = connection.serialize()
        self.commits += 1
        # Events the observer's store hook cannot see (those of a store's own
        # startup: reconciliation, eviction over the cap) reach it here.
        if "events" not in {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}:
            return
        rows = connection.execute(
            "SELECT seq, kind, payload FROM events WHERE seq > ? ORDER BY seq", [self.followed_seq]
        ).fetchall()
        for seq, kind, payload in rows:
            self.kinds[kind] += 1
            self._follow(decode_event(kind, payload))
            self.followed_seq = seq

    def digest(self) -> str:
        return hashlib.sha256(self.durable or b"").hexdigest()


@attrs.define(kw_only=True)
class _Run:
    options: RunOptions
    lane: Lane
    disk: SimDisk
    journal: JournalImage
    observer: Observer
    boundary: BoundaryChecks
    schedule: BoundarySchedule
    # Every store, journal and writer of the run takes it (the mutations turn safeguards off).
    safeguards: Safeguards
    loaded: Any
    clock: Any
    rng: random.Random
    conversations: dict[int, tuple[int, ...]]
    system_prompt: tuple[int, ...]
    crash_power: bool = True
    crashes: int = 0
    restarts: int = 0
    requests: int = 0
    flushes: int = 0
    durable_flushes: int = 0
    phase_puts_from: int = 0
    entry_numbers: Any = attrs.Factory(itertools.count)
    decode_steps_by_rows: Counter[int] = attrs.Factory(Counter)
    # The checkpoints workload: the request (or burst) a crash cut off, sent again after recovery.
    cut_off: Request | Burst | None = None

    def clock_ns(self) -> int:
        return EPOCH_NS + int(self.clock.current_time() * 1e9)


def _open_store(run: _Run, *, journal: bool = True, observed: bool = False) -> SsdStore:
    """A store of the run on its SimDisk; `observed`: the system's, whose
    events and restores the observer sees through the store's listeners."""

    def new_entry_id() -> str:
        return f"{next(run.entry_numbers):032x}"

    index_lock, journal_runner = run.boundary.new_store_seams()
    listeners = run.observer.store_listeners() if observed else {}
    return SsdStore.open(
        CACHE_DIR,
        FINGERPRINT,
        run.options.ssd_bytes_max,
        run.disk,
        verify=True,
        journal=journal,
        clock_ns=run.clock_ns,
        journal_opener=lambda path: Journal.open_in_memory(
            path, run.journal, clock_ns=run.clock_ns, runner=journal_runner, safeguards=run.safeguards
        ),
        new_entry_id=new_entry_id,
        timer_ns=run.clock_ns,
        owner=f"simulated server, seed {run.options.seed}",
        index_lock=index_lock,
        safeguards=run.safeguards,
        **listeners,
    )


def _config(run: _Run) -> SystemConfig:
    return SystemConfig(
        model_dir=Path("/sim/model"),
        ssd_dir=CACHE_DIR,
        ssd_bytes_max=run.options.ssd_bytes_max,
        prompt_cache_bytes=run.options.prompt_cache_bytes,
        spill_queue_bytes=256 * 1024,
        write_behind=True,
        demote_idle_s=6.0,
        debounce_s=0.5,
        busy_rearm_s=1.0,
        prefill_step_tokens=64,
        shutdown_timeout_s=60.0,
        batch_rows_max=run.lane.rows,
        kv_budget_bytes=run.lane.kv_budget_bytes,
        # The fake model's memory is no real footprint, and the guard's probe
        # would take an engine turn of virtual time: off, as `--memory-budget 0`.
        memory_budget_bytes=0,
        # The restore policy times real work with the wall clock and probes the disk: a run must
        # replay exactly, so every hit is restored, as `--restore-policy restore`.
        restore_policy="restore",
        generation_checkpoint_tokens=run.options.shape.generation_checkpoint_tokens,
    )


def _seams(run: _Run) -> SystemSeams:
    """The simulated world: an inline engine, the mock clock, seeded blocking
    calls, the run's store on its SimDisk, and the run's safeguards."""
    return SystemSeams(
        engine=InlineEngine(run.loaded, delay_s=run.schedule.delay_s),
        clock_s=run.clock.current_time,
        run_blocking=SeededBlocking(run.schedule),
        store_opener=lambda config, scheme: _open_store(run, observed=True),
        safeguards=run.safeguards,
        checkpoint_listeners=(run.observer.checkpoints.listener,),
        drafter=run.observer.drafter,
    )


async def _request(run: _Run, system: Any, request: Request, *, variant: bool = False) -> None:
    """Send a conversation's next request; a `variant` (the checkpoints
    workload's changed policy) leaves the conversation as it was."""
    history = run.conversations.setdefault(request.conversation, run.system_prompt)
    prompt = history + request.user_tokens
    generation = GenerationRequest(
        prompt_ids=prompt, params=SamplingParams(max_tokens=request.max_tokens), namespace=request.namespace
    )
    produced: list[int] = []
    run.requests += 1
    try:
        async for item in system.generate(generation):
            if isinstance(item, TokenDelta) and item.token_id >= 0:
                produced.append(item.token_id)
            elif isinstance(item, GenerationDone) and item.cached_tokens > len(prompt):
                run.observer.violate("reuse_within_prompt", f"{item.cached_tokens} cached of {len(prompt)}")
    except KvCellarError as e:
        if run.disk.crashed:
            # The process is dying: a batch row fails as its job is cancelled
            # (a serial request is just cancelled); no client is left to see it.
            return
        run.observer.violate("request_succeeds", f"a request failed: {e}", kind="crash")
        return
    if run.options.shape.generation_checkpoint_tokens:
        _check_output(run, prompt, request.max_tokens, produced)
    if not variant:
        run.conversations[request.conversation] = prompt + tuple(produced)


def _check_output(run: _Run, prompt: tuple[int, ...], max_tokens: int, produced: list[int]) -> None:
    """A completed generation, resumed or not, is the fake model's greedy
    continuation: what an uninterrupted run produces."""
    if not isinstance(run.loaded.model, FakeModel):
        return
    tokens, expected = list(prompt), []
    for _ in range(max_tokens):
        expected.append(next_token(tokens[-1], len(tokens) - 1))
        tokens.append(expected[-1])
    if produced != expected:
        first = next((i for i, (a, b) in enumerate(zip(produced, expected, strict=False)) if a != b), None)
        run.observer.violate(
            "generation_output_exact",
            f"a {len(prompt)}-token prompt's {len(produced)} tokens differ from the uninterrupted "
            f"{len(expected)} (first at {first})",
        )


async def _send_cut_off_again(run: _Run, system: Any) -> None:
    """After a crash cut a request off: first a changed policy (one more
    token), which must start normally, then the identical request, which
    resumes its checkpoint."""
    step = run.cut_off
    if step is None:
        return
    requests = step.requests if isinstance(step, Burst) else (step,)
    for request in requests:
        await _request(run, system, attrs.evolve(request, max_tokens=request.max_tokens + 1), variant=True)
    await _step(run, system, step)
    run.cut_off = None


def _record_verdict(run: _Run, system: Any, durable: bool, puts_before: int) -> None:
    """Count a flush verdict; a durable one claims this process's puts made before it."""
    run.flushes += 1
    run.durable_flushes += int(durable)
    if system.store is not None:
        run.observer.flush_reported(durable, run.phase_puts_from, puts_before, system.store)


async def _flush(run: _Run, system: Any) -> Any:
    puts_before = len(run.observer.puts)
    verdict = await system.flush()
    _record_verdict(run, system, verdict.durable, puts_before)
    return verdict


async def _step(run: _Run, system: Any, step: Step) -> None:
    if isinstance(step, Request):
        await _request(run, system, step)
    elif isinstance(step, Burst):
        async with trio.open_nursery() as nursery:
            for request in step.requests:
                nursery.start_soon(_request, run, system, request)
    elif isinstance(step, Fork):
        source = run.conversations.get(step.source, run.system_prompt)
        run.conversations[step.target] = source[: max(1, int(len(source) * step.keep_fraction))]
    elif isinstance(step, Flush):
        await _flush(run, system)
    elif isinstance(step, Idle):
        await trio.sleep(step.seconds)
    elif isinstance(step, Crash):
        run.disk.crash_at_op = run.disk.ops_done + step.within_ops
        run.crash_power = step.power
    elif isinstance(step, Wipe):
        async with trio.open_nursery() as nursery:
            for request in step.alongside:
                nursery.start_soon(_request, run, system, request)
            await trio.sleep(0.001 * len(step.alongside))
            await _wipe(run, system, WipeSelector(namespace=step.namespace))
    _check_wiped_stay_wiped(run, system)


async def _wipe(run: _Run, system: Any, selector: WipeSelector) -> None:
    """One wipe; a done one joins the observer's no-resurrection invariant (a fault may leave one
    undone: it says what is left and the next wipe or start finishes it)."""
    result = await system.wipes.wipe(selector)
    if result.done:
        run.observer.wipe_completed(selector)


def _check_wiped_stay_wiped(run: _Run, system: Any) -> None:
    run.observer.check_wiped_stay_wiped(system.prompt_cache.keys(), "the RAM tier")
    if system.store is not None:
        run.observer.check_wiped_stay_wiped(_keys_of(system.store), "the SSD tier")


def _keys_of(store: SsdStore) -> list[tuple[str, Any]]:
    return [(entry.namespace, entry.tokens) for entry in _indexed_entries(store)]


def _crashed(error: BaseException) -> bool:
    if isinstance(error, SimulatedCrash):
        return True
    if isinstance(error, BaseExceptionGroup):
        return any(_crashed(e) for e in error.exceptions)
    return error.__context__ is not None and _crashed(error.__context__)


async def _phase(run: _Run, steps: list[Step], index: int, *, last: bool) -> tuple[str, int]:
    """Open the system, run steps from `index` until a restart, a crash or the
    end; returns ("restart" | "crashed" | "end", next index)."""
    run.phase_puts_from = len(run.observer.puts)
    system = None
    try:
        async with open_system(_config(run), _seams(run)) as system:
            run.observer.attach(system)
            await _send_cut_off_again(run, system)
            while index < len(steps):
                step = steps[index]
                index += 1
                if isinstance(step, Restart):
                    run.restarts += 1
                    await _graceful_shutdown(run, system)
                    return "restart", index
                await _step(run, system, step)
            if last:
                await _liveness(run, system)
            await _graceful_shutdown(run, system)
            return "end", index
    except BaseException as error:  # the injected crash arrives wrapped in groups
        if _crashed(error):
            return "crashed", index
        raise
    finally:
        # The Scheduler's counts outlive the system, crashed or not.
        if system is not None and system.scheduler is not None:
            run.decode_steps_by_rows.update(system.scheduler.decode_steps_by_rows)


async def _graceful_shutdown(run: _Run, system: Any) -> None:
    puts_before = len(run.observer.puts)
    verdict = await system.shutdown()
    if verdict is not None and system.store is not None:
        _record_verdict(run, system, verdict.durable, puts_before)


async def _liveness(run: _Run, system: Any) -> None:
    """Once faults stop, a flush must settle within a few tries: nothing
    pending, dropped or failed, and durable unless a prefix was already lost
    (its RAM entry gone while its write failed under a fault or its spill was
    dropped) — spec §5.6 keeps such a prefix reported missing for good."""
    run.disk.faults_off()
    for _ in range(LIVENESS_FLUSHES):
        verdict = await _flush(run, system)
        loss_explained = bool(run.options.faults) or (system.queue is not None and system.queue.stats()["dropped"])
        if verdict.durable or (not verdict.pending and not verdict.failed and not verdict.dropped and loss_explained):
            return
        await trio.sleep(2.0)
    run.observer.violate(
        "flush_becomes_durable",
        f"with faults off, {LIVENESS_FLUSHES} flushes in a row did not settle "
        f"(last: {verdict.pending} pending, {verdict.failed} failed, {verdict.dropped} dropped, "
        f"{verdict.missing} missing)",
        kind="liveness",
    )


def _recover_from_crash(run: _Run) -> None:
    run.crashes += 1
    if run.crash_power:
        run.disk.crash(run.rng)
    else:
        run.disk.crash_clean()
    run.crash_power = True
    # A crash during the next recovery too, now and then.
    if run.rng.random() < 0.3:
        run.disk.crash_at_op = run.disk.ops_done + run.rng.randint(1, 12)


async def _workload(run: _Run, steps: list[Step]) -> None:
    index = 0
    if run.options.crash_at_op is not None:
        run.disk.crash_at_op = run.options.crash_at_op
    while True:
        outcome, index = await _phase(run, steps, index, last=True)
        if outcome == "crashed":
            _recover_from_crash(run)
            cut = steps[index - 1] if index > 0 else None
            if run.options.shape.generation_checkpoint_tokens and isinstance(cut, Request | Burst):
                run.cut_off = run.cut_off or cut
            continue
        if outcome == "end":
            return


def simulate(
    options: RunOptions, *, keep: bool = False, watch: Callable[[_Run], Callable[[int, str], None]] | None = None
) -> RunResult:
    """Run one seed to the end; never raises for what the system under test
    does wrong (that is a violation in the result). With `keep`, the result
    carries the final disk and journal image. `watch(run)` returns what the
    disk tells of each crash point of the workload (`SimDisk.before_operation`;
    the crash images), and must leave the run as it found it."""
    determinism.seed_trio(options.seed)
    clock = trio.testing.MockClock(autojump_threshold=0)
    run = _new_run(options, clock)
    disk = run.disk
    steps = build_workload(options.seed, options.shape)
    claims_checked = 0
    workload_ops = 0
    if watch is not None:
        disk.before_operation = watch(run)
    with _quiet_logs():
        try:
            try:
                trio.run(_workload, run, steps, clock=clock)
            finally:
                disk.before_operation = None
            workload_ops = disk.ops_done
            claims_checked = _verify_recovery(run)
        except Exception as error:
            run.observer.violate(
                "no_unexpected_error", "".join(traceback.format_exception(error))[-2000:], kind="crash"
            )
    return RunResult(
        seed=options.seed,
        violations=list(run.observer.violations),
        journal_digest=run.journal.digest(),
        disk_digest=disk.image_digest(),
        disk_ops=disk.ops_done,
        workload_ops=workload_ops,
        crashes=run.crashes,
        restarts=run.restarts,
        requests=run.requests,
        flushes=run.flushes,
        durable_flushes=run.durable_flushes,
        claims_checked=claims_checked,
        sim_time_s=round(clock.current_time(), 3),
        batch_rows=run.lane.rows,
        decode_steps_by_rows=dict(sorted(run.decode_steps_by_rows.items())),
        journal_kinds=dict(run.journal.kinds),
        checkpoint_resumes=run.observer.checkpoints.resumes,
        kept_disk=disk if keep else None,
        kept_journal=run.journal.durable if keep else None,
    )


def _new_run(options: RunOptions, clock: trio.testing.MockClock) -> _Run:
    """A seed's run before its workload: the simulated disk, the model, the observer and its checks."""
    safeguards = mutations.safeguards_without(options.mutations)
    disk_rng = random.Random(f"disk-{options.seed}")
    disk = SimDisk(
        rng=disk_rng,
        root=SIM_ROOT,
        faults=combined_faults(options.faults),
        clock_ns=lambda: EPOCH_NS + int(clock.current_time() * 1e9),
    )
    loaded = _loaded_model(options)
    observer = Observer(
        disk,
        loaded.model,
        corruption_faults=bool({"bitflip", "misdirect"} & options.faults),
        drafter=fake_drafter() if options.shape.companion else None,
    )
    boundary = BoundaryChecks(observer.violate)
    disk.on_operation = boundary.disk_operation
    return _Run(
        options=options,
        lane=lane_for_seed(options.seed, options.batch_rows),
        disk=disk,
        journal=JournalImage(disk, observer.follow, boundary.journal_transaction),
        observer=observer,
        boundary=boundary,
        schedule=BoundarySchedule(random.Random(f"boundary-{options.seed}")),
        safeguards=safeguards,
        loaded=loaded,
        clock=clock,
        rng=random.Random(f"crash-{options.seed}"),
        conversations={},
        system_prompt=system_prompt(options.seed, options.shape),
    )


def _loaded_model(options: RunOptions) -> Any:
    if options.real_model_dir is None:
        # A recurrent target is refused speculation (it cannot trim): the companion workload's never is.
        return fake_loaded_model(recurrent=options.seed % 3 == 2 and not options.shape.companion)
    from kvcellar.engine.engine import _load

    return _load(options.real_model_dir)


def _indexed_entries(store: SsdStore) -> list[IndexedEntry]:
    """Every indexed entry in `entry_ids()` order; nothing else uses the store meanwhile."""
    entries = []
    for entry_id in store.entry_ids():
        entry = store.entry(entry_id)
        if entry is None:
            raise RuntimeError(f"entry {entry_id} left the SSD index while the harness read it")
        entries.append(entry)
    return entries


def _index_of(store: SsdStore) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(entry.entry_id, entry.namespace, tuple(int(t) for t in entry.tokens)) for entry in _indexed_entries(store)]


def _verify_recovery(run: _Run) -> int:
    """After the workload, with faults off: the startup index equals a fresh
    scan and the reconciled journal; recovering again changes nothing; every
    live durable claim restores byte-identical; with a draft model, every entry
    restores in a form it was put in (its companion state with it). Returns the
    claims checked."""
    run.disk.faults_off()
    run.disk.crash_at_op = None
    observer = run.observer
    store = _open_store(run)
    try:
        journaled = _index_of(store)
        _check_nothing_left_to_supersede(run, store)
        projection = store.journal.entries() if store.journal else []
        replayed = store.journal.replay() if store.journal else []
    finally:
        store.close()
    if projection != replayed:
        observer.violate("journal_replays_to_projection", "replaying the events does not rebuild `entries`")
    if sorted(row["entry_id"] for row in projection) != [row[0] for row in journaled]:
        observer.violate("index_matches_journal", "the startup index and the journal's entries differ")
    _check_idempotent(run, journaled)
    _check_fresh_scan(run, journaled)
    store = _open_store(run)
    try:
        observer.check_wiped_stay_wiped(_keys_of(store), "the SSD tier after recovery")
        claims_checked = observer.check_claims(store)
        if observer.drafter is not None:
            observer.check_entries_as_put(store, _indexed_entries(store))
        return claims_checked
    finally:
        store.close()


def _check_nothing_left_to_supersede(run: _Run, store: SsdStore) -> None:
    """No two entries of a namespace hold the same tokens, and no entry is a
    strict prefix of a trimmable one that can be trimmed that far: a removal
    is not directory-fsynced, so startup must redo what a power loss undid.
    Checked pairwise, independently of the store's prefix index."""
    entries = _indexed_entries(store)
    for entry in entries:
        for other in entries:
            if other is entry or other.namespace != entry.namespace or other.tokens.size < entry.tokens.size:
                continue
            same = other.tokens.size == entry.tokens.size
            if not np.array_equal(other.tokens[: entry.tokens.size], entry.tokens):
                continue
            if same or (other.trimmable and other.minimum_reusable_offset <= entry.tokens.size):
                run.observer.violate(
                    "nothing_left_to_supersede",
                    f"entry {entry.entry_id} ({entry.tokens.size} tokens) is "
                    f"{'a duplicate of' if same else 'superseded by'} {other.entry_id} after startup",
                )
                return


def _check_fresh_scan(run: _Run, journaled: list[Any]) -> None:
    scanned = _open_store(run, journal=False)
    try:
        fresh = _index_of(scanned)
        quarantined = scanned.counters.quarantined
    finally:
        scanned.close()
    # Silent corruption is invisible to the journal's trusted-file shortcut; a
    # full scan quarantines it (and restore would): only those may differ.
    tolerated = quarantined if run.observer.corruption_faults else 0
    if fresh != journaled and not (set(fresh) <= set(journaled) and len(journaled) - len(fresh) <= tolerated):
        run.observer.violate(
            "index_matches_fresh_scan",
            f"startup index ({len(journaled)} entries) differs from a fresh scan ({len(fresh)})",
        )


def _check_idempotent(run: _Run, journaled: list[Any]) -> None:
    """A second recovery right after the first finds the same index and
    journals nothing (every committed event passes `JournalImage.committed`)."""
    seq_before = run.journal.followed_seq
    store = _open_store(run)
    try:
        again = _index_of(store)
    finally:
        store.close()
    added = run.journal.followed_seq - seq_before
    if again != journaled or added:
        run.observer.violate(
            "recovery_is_idempotent", f"a second recovery changed the index or journaled {added} new events"
        )


class _quiet_logs:
    """Store and actor warnings are expected under injected faults; keep sweeps readable."""

    def __enter__(self) -> None:
        self._level = logging.getLogger("kvcellar").level
        logging.getLogger("kvcellar").setLevel(logging.CRITICAL)

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger("kvcellar").setLevel(self._level)
