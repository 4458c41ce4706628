"""Crash images: every crash point of a run checked without replaying it.

A crash-point run (`RunOptions.crash_at_op`) replays the whole workload up
to its crash point, recovers the system and runs the rest of the workload:
enumerating a workload's N crash points that way costs N full runs. A crash
image costs one recovery instead. The run goes through its workload once,
uncrashed; before each disk operation k (and each journal commit) the
explorer copies what a power loss at that instant would find — the disk's
inodes with their pending writes and directory operations, the journal's
durable image, the durable claims made so far — lets the copy lose power
(`SimDisk.crash`, from a stream of its own per point), and checks recovery
on it exactly as a run's end does (`_verify_recovery`): the startup index
equals the reconciled journal and a fresh scan, replaying the journal
rebuilds its projection, a second recovery changes nothing, nothing is left
to supersede, and every durable claim restores byte-identical. The run
itself never sees the copies: its digests are those of the same run without
the explorer.

What an image does not cover, a crash-point run does: the system's own
startup (its actors, a crash during recovery) and the workload after it.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Collection
from typing import Any

import attrs

from kvcellar.simulations.boundary import BoundaryChecks
from kvcellar.simulations.harness import JournalImage, RunOptions, RunResult, _Run, _verify_recovery, simulate
from kvcellar.simulations.observer import Claim, Observer, Violation
from kvcellar.simulations.sim_disk import SimDisk

# Entry ids of what recovery on an image creates: far above the run's own, so they never collide.
IMAGE_ENTRY_NUMBER_START = 1 << 100


@attrs.frozen(kw_only=True)
class ImageResult:
    """One crash point's image: the operation it cut off and what recovery
    broke. `same_as`: the earlier point whose image this one is (nothing a
    power loss keeps changed in between), checked once for both."""

    point: int
    operation: str
    violations: tuple[Violation, ...]
    claims_checked: int
    same_as: int | None = None

    @property
    def ok(self) -> bool:
        return not self.violations


@attrs.define(kw_only=True)
class ExploredRun:
    """The run (as `simulate` returns it) and the images of its crash points."""

    run: RunResult
    images: list[ImageResult] = attrs.Factory(list)

    @property
    def failures(self) -> list[ImageResult]:
        return [image for image in self.images if not image.ok]

    @property
    def recoveries(self) -> int:
        """Images recovered: the crash points less those that repeat the image before them."""
        return sum(image.same_as is None for image in self.images)


def image_key(run: _Run) -> tuple[Any, ...]:
    """What a power loss now would start from: the disk's changes, the
    journal's commits, the claims. Equal keys at two points of a run mean
    equal images (the power loss draws from `image_rng(seed, key)`)."""
    claims = tuple((claim.entry_id, claim.released) for claim in run.observer.claims)
    return (run.disk.changes, run.journal.commits, claims)


def image_rng(seed: int, key: tuple[Any, ...]) -> random.Random:
    """The power loss of an image: a stream of its own, drawn from the seed
    and the state it starts from, so an image replays alone
    (`explore(options, points={point})`)."""
    return random.Random(f"image-{seed}-{key[0]}-{key[1]}")


def explore(options: RunOptions, *, points: Collection[int] | None = None) -> ExploredRun:
    """Run `options` once; check the crash image before every disk operation
    of its workload (or only those numbered in `points`)."""
    images: list[ImageResult] = []

    def watch(run: _Run) -> Callable[[int, str], None]:
        last: list[tuple[tuple[Any, ...], ImageResult]] = []

        def before_operation(number: int, operation: str) -> None:
            if points is not None and number not in points:
                return
            key = image_key(run)
            if last and last[0][0] == key:
                image = attrs.evolve(last[0][1], point=number, operation=operation, same_as=last[0][1].point)
            else:
                image = _check_image(run, number, operation, key)
                last[:] = [(key, image)]
            images.append(image)

        return before_operation

    return ExploredRun(run=simulate(options, watch=watch), images=images)


def _check_image(run: _Run, point: int, operation: str, key: tuple[Any, ...]) -> ImageResult:
    disk = run.disk.crashed_copy(image_rng(run.options.seed, key))
    observer = _observer_copy(run.observer, disk)
    boundary = BoundaryChecks(observer.violate)
    disk.on_operation = boundary.disk_operation
    journal = JournalImage(disk, observer.follow, boundary.journal_transaction)
    journal.durable = run.journal.durable
    journal.followed_seq = run.journal.followed_seq
    image = attrs.evolve(
        run,
        disk=disk,
        journal=journal,
        observer=observer,
        boundary=boundary,
        entry_numbers=itertools.count(IMAGE_ENTRY_NUMBER_START),
    )
    claims_checked = 0
    try:
        claims_checked = _verify_recovery(image)
    except Exception as error:
        observer.violate("no_unexpected_error", f"recovering the image raised {error!r}", kind="crash")
    return ImageResult(
        point=point, operation=operation, violations=tuple(observer.violations), claims_checked=claims_checked
    )


def _observer_copy(observer: Observer, disk: SimDisk) -> Observer:
    """What the run's observer knows at the crash point, on the image's disk:
    its claims are copied (recovery may release them), its oracle shared (read only)."""
    copied = Observer(disk, observer.model, corruption_faults=observer.corruption_faults, drafter=observer.drafter)
    copied.oracle = observer.oracle
    copied.put_forms = observer.put_forms
    copied.puts = observer.puts
    copied.claims = [Claim(**attrs.asdict(claim)) for claim in observer.claims]
    copied.evicted_since_put = observer.evicted_since_put
    copied._put_epochs = observer._put_epochs
    return copied
