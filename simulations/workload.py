"""Workloads built from a seed: conversations with shared and diverging
prefixes, bursts of concurrent requests, flushes, idle gaps (debounce timers,
idle demotion), graceful restarts and crashes.

A workload is a plain list of steps generated up front from its own
`random.Random`, so the same seed always asks the same things of the system.
A request names a conversation, not tokens: its prompt is that
conversation's history (whatever the system answered so far) plus new user
tokens drawn here.
"""

from __future__ import annotations

import random

import attrs

from kvcellar.simulations.fake_engine import VOCAB_SIZE


@attrs.frozen(kw_only=True)
class Request:
    conversation: int
    user_tokens: tuple[int, ...]
    max_tokens: int
    namespace: str = ""


@attrs.frozen(kw_only=True)
class Burst:
    """Requests sent at once (they queue at the gateway and interleave with timers)."""

    requests: tuple[Request, ...]


@attrs.frozen(kw_only=True)
class Fork:
    """A new conversation that shares a prefix of another and then diverges."""

    source: int
    target: int
    keep_fraction: float


@attrs.frozen(kw_only=True)
class Flush:
    pass


@attrs.frozen(kw_only=True)
class Idle:
    seconds: float


@attrs.frozen(kw_only=True)
class Restart:
    """Graceful: shutdown (drain + flush) and open again."""


@attrs.frozen(kw_only=True)
class Crash:
    """Crash within the next `within_ops` disk operations; `power` loses what
    was not synced, otherwise only the process dies."""

    within_ops: int
    power: bool


@attrs.frozen(kw_only=True)
class Wipe:
    """`POST /admin/cache/wipe` of one namespace (`{"namespace": ...}`), begun while `alongside`
    runs: their puts evict and spill entries whose writes wait for an idle engine, so a write
    begun before the wipe is still in flight when it removes."""

    namespace: str
    alongside: tuple[Request, ...] = ()


Step = Request | Burst | Fork | Flush | Idle | Restart | Crash | Wipe


@attrs.frozen(kw_only=True)
class WorkloadShape:
    steps: int = 24
    conversations: int = 3
    system_prompt_tokens: tuple[int, int] = (16, 48)
    user_tokens: tuple[int, int] = (4, 40)
    long_prompt_rate: float = 0.08
    long_prompt_tokens: int = 520
    max_tokens: tuple[int, int] = (1, 8)
    restarts: bool = True
    crashes: bool = True
    namespaces: tuple[str, ...] = ("", "team-b")
    # In-flight generation checkpoints every this many tokens (0: off, the
    # default). On, the workload is `build_checkpoint_workload`'s: long
    # generations, crashes in the middle of them, and each request a crash
    # cut off sent again after recovery (first changed, then identical).
    generation_checkpoint_tokens: int = 0
    # Cache wipes of one namespace now and then (issue 39; off by default, so the
    # default workloads, and their recorded digests, are unchanged).
    wipes: bool = False
    # A draft model serves beside the target (issue 42): every decoding request keeps the draft's
    # caches as companion state in the entries it leaves (off by default, like `wipes`).
    companion: bool = False


SMALL_SHAPES = {
    "chat": WorkloadShape(
        steps=8, conversations=2, restarts=False, crashes=False, long_prompt_rate=0.0, namespaces=("",)
    ),
    "fork": WorkloadShape(
        steps=8, conversations=2, restarts=True, crashes=False, long_prompt_rate=0.0, namespaces=("",)
    ),
    "hybrid": WorkloadShape(
        steps=7, conversations=2, restarts=False, crashes=False, long_prompt_rate=0.0, namespaces=("", "team-b")
    ),
    "checkpoints": WorkloadShape(
        steps=8,
        conversations=2,
        system_prompt_tokens=(16, 32),
        user_tokens=(4, 16),
        long_prompt_rate=0.0,
        max_tokens=(24, 72),
        namespaces=("", "team-b"),
        generation_checkpoint_tokens=8,
    ),
    # Longer prompts than the default: RAM evictions spill while the wipe runs.
    "wipes": WorkloadShape(
        steps=8,
        conversations=3,
        user_tokens=(24, 64),
        long_prompt_rate=0.0,
        namespaces=("", "team-b"),
        wipes=True,
    ),
    # Speculative decoding: the entries carry the draft's caches through every tier and crash.
    "companion": WorkloadShape(
        steps=8,
        conversations=2,
        user_tokens=(8, 40),
        long_prompt_rate=0.0,
        max_tokens=(2, 12),
        namespaces=("", "team-b"),
        companion=True,
    ),
}


def _tokens(rng: random.Random, bounds: tuple[int, int]) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB_SIZE - 1) for _ in range(rng.randint(*bounds)))


def _request(rng: random.Random, shape: WorkloadShape, conversation: int) -> Request:
    long = rng.random() < shape.long_prompt_rate
    bounds = (shape.long_prompt_tokens, shape.long_prompt_tokens + 16) if long else shape.user_tokens
    return Request(
        conversation=conversation,
        user_tokens=_tokens(rng, bounds),
        max_tokens=rng.randint(*shape.max_tokens),
        namespace=shape.namespaces[conversation % len(shape.namespaces)],
    )


def system_prompt(seed: int, shape: WorkloadShape) -> tuple[int, ...]:
    """The prefix every conversation starts with (shared across them)."""
    return _tokens(random.Random(f"system-{seed}"), shape.system_prompt_tokens)


def build_workload(seed: int, shape: WorkloadShape = WorkloadShape()) -> list[Step]:
    if shape.generation_checkpoint_tokens:
        return build_checkpoint_workload(seed, shape)
    rng = random.Random(f"workload-{seed}")
    conversations = shape.conversations
    steps: list[Step] = [_request(rng, shape, c) for c in range(min(conversations, 2))]
    while len(steps) < shape.steps:
        roll = rng.random()
        if roll < 0.40:
            steps.append(_request(rng, shape, rng.randrange(conversations)))
        elif roll < 0.52:
            steps.append(
                Burst(
                    requests=tuple(_request(rng, shape, rng.randrange(conversations)) for _ in range(rng.randint(2, 3)))
                )
            )
        elif roll < 0.60:
            steps.append(
                Fork(
                    source=rng.randrange(conversations),
                    target=conversations,
                    keep_fraction=rng.choice((0.3, 0.6, 0.9, 1.0)),
                )
            )
            steps.append(_request(rng, shape, conversations))
            conversations += 1
        elif roll < 0.75:
            steps.append(Flush())
        elif roll < 0.87:
            steps.append(Idle(seconds=rng.choice((0.3, 1.5, 4.0, 12.0))))
        elif roll < 0.93 and shape.restarts:
            steps.append(Restart())
        elif shape.crashes:
            steps.append(Crash(within_ops=rng.randint(1, 60), power=rng.random() < 0.75))
        if shape.wipes and rng.random() < 0.5:
            alongside = tuple(_request(rng, shape, rng.randrange(conversations)) for _ in range(rng.randint(1, 3)))
            steps.append(Wipe(namespace=rng.choice(shape.namespaces), alongside=alongside))
    steps.append(Flush())
    return steps


def build_checkpoint_workload(seed: int, shape: WorkloadShape) -> list[Step]:
    """Long generations, most of them preceded by a crash due within the next
    disk operations (the checkpoint writes happen while they generate), a
    burst now and then (rows of the batch lane checkpoint independently),
    and flushes and restarts between them."""
    rng = random.Random(f"checkpoint-workload-{seed}")
    steps: list[Step] = []
    while len(steps) < shape.steps:
        roll = rng.random()
        if roll < 0.55 and shape.crashes:
            steps.append(Crash(within_ops=rng.randint(4, 48), power=rng.random() < 0.5))
        elif roll < 0.62 and shape.restarts:
            steps.append(Restart())
        elif roll < 0.72:
            steps.append(Flush())
        if rng.random() < 0.2:
            requests = tuple(_request(rng, shape, rng.randrange(shape.conversations)) for _ in range(2))
            steps.append(Burst(requests=requests))
        else:
            steps.append(_request(rng, shape, rng.randrange(shape.conversations)))
    steps.append(Flush())
    return steps
