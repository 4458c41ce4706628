"""Speculative decoding on the serial lane (issue 42): a draft model proposes,
the target verifies, on mlx-lm's contract (`mlx_lm.generate.
speculative_generate_step`), with the draft's caches kept as companion state
in every tier (store/companion.py).

One round, from a pending token p the target has not yet run: the draft runs
its lag (tokens the target's caches cover and the draft's do not) and p, then
proposes k tokens greedily; the target runs `[p, d1..dk]` in one forward and
the request's own sampler (`SerialSampling`, processors included) draws each
position in order, stopping at the first draw that differs from the draft's
proposal. Every draw is one the plain loop would make at that position with
the same context and the same sampler state (one draw per emitted token, so
a seeded chain advances exactly as without a draft), so greedy and seeded
output is the plain loop's token for token, up to the kernels' rounding of a
(k+1)-token forward against a one-token one. Both caches are then trimmed back
to the tokens emitted before the last one (which becomes the next p).

A round never runs where a trim would be unsound: rotating rings stay below
their wrap, a chunked cache inside its current chunk (its front must not
move); k shrinks, down to 0 (a plain step). Requests whose reply speculation
cannot reproduce exactly are served by the plain loop, the reason counted
(`refusal`). Engine thread only, except `SpeculationStats`, a monitor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from kvcellar.engine.engine import PREFILL_STEP_TOKENS, prefill
from kvcellar.engine.sampling import SerialSampling
from kvcellar.engine.scalars import item_int
from kvcellar.errors import ModelError, UsageError
from kvcellar.store.companion import SplitEntry
from kvcellar.store.scheme import KvScheme, warm_up_prototype_caches

# Why a request (or a generation from some point on) decodes without the draft.
REFUSED_LOGPROBS = "logprobs"
REFUSED_GRAMMAR = "grammar"
REFUSED_REQUEST_PROCESSORS = "request_processors"
REFUSED_PAGED_KV = "paged_kv"
REFUSED_UNTRIMMABLE = "untrimmable_cache"
# The batch lane has no per-row acceptance yet: a speculative request runs on the serial lane (counted).
ON_SERIAL_LANE = "batch_lane_has_no_per_row_acceptance"
log = logging.getLogger("kvcellar.speculative")
# A round's k where nothing bounds it (plain and quantized KV).
_UNBOUNDED = 1 << 30


class SpeculationStats:
    """The speculation counters: a monitor (the engine thread counts, `/stats`
    and `/metrics` copy a `snapshot` on the Trio thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.refused: dict[str, int] = {}
        self.rounds = 0
        self.proposed_tokens = 0
        self.accepted_tokens = 0
        self.emitted_tokens = 0
        self.draft_s = 0.0
        self.verify_s = 0.0
        # Takes whose target KV served without usable draft state, by reason (store/companion.py).
        self.draft_reprefills: dict[str, int] = {}
        self.draft_reprefill_tokens = 0
        self.companion_restored = 0
        self.serial_fallbacks = 0

    def count_refused(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1

    def count_request(self) -> None:
        with self._lock:
            self.requests += 1

    def count_serial_fallback(self) -> None:
        with self._lock:
            self.serial_fallbacks += 1

    def count_companion(self, reason: str, reprefill_tokens: int) -> None:
        """A take's draft state: restored ("" reason) or re-prefilled over `reprefill_tokens`."""
        with self._lock:
            if not reason:
                self.companion_restored += 1
                return
            self.draft_reprefills[reason] = self.draft_reprefills.get(reason, 0) + 1
            self.draft_reprefill_tokens += reprefill_tokens

    def count_round(self, proposed: int, accepted: int, emitted: int, draft_s: float, verify_s: float) -> None:
        with self._lock:
            self.rounds += 1
            self.proposed_tokens += proposed
            self.accepted_tokens += accepted
            self.emitted_tokens += emitted
            self.draft_s += draft_s
            self.verify_s += verify_s

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            busy_s = self.draft_s + self.verify_s
            return {
                "requests": self.requests,
                "refused": dict(self.refused),
                "serial_fallbacks": self.serial_fallbacks,
                "rounds": self.rounds,
                "proposed_tokens": self.proposed_tokens,
                "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0,
                "accepted_tokens_per_step": self.accepted_tokens / self.rounds if self.rounds else 0.0,
                "tokens_per_step": self.emitted_tokens / self.rounds if self.rounds else 0.0,
                "draft_time_share": self.draft_s / busy_s if busy_s else 0.0,
                "companion_restored": self.companion_restored,
                "draft_reprefills": dict(self.draft_reprefills),
                "draft_reprefill_tokens": self.draft_reprefill_tokens,
            }


@attrs.define(kw_only=True, eq=False)
class Drafter:
    """The draft model serving beside the target: its weights, how many tokens
    it proposes per round, its fingerprint digest (the companion's identity),
    its caches' bytes per token (plain KV in the compute dtype: what the
    memory guard's admission adds for a request the draft may serve), and the
    counters."""

    model: Any
    model_dir: Path
    num_draft_tokens: int
    digest: str
    kv_bytes_per_token: int = 0
    stats: SpeculationStats = attrs.field(factory=SpeculationStats)

    def admission_kv_bytes_per_token(self, request: Any) -> int:
        """The draft's KV bytes per token a request's admission counts: 0 when
        the request itself is refused the draft (it then never makes draft KV)."""
        return 0 if request_refusal(request) is not None else self.kv_bytes_per_token

    def serial_lane_wanted(self, request: Any) -> bool:
        """Whether a request the draft can serve leaves the batch lane for the
        serial lane (it has no per-row acceptance yet): counted when it does."""
        if request_refusal(request) is not None:
            return False
        self.stats.count_serial_fallback()
        return True


def admission_draft_kv_bytes_per_token(drafter: Drafter | None, request: Any) -> int:
    """What a request's memory admission adds per token for the draft's KV: 0 without a draft."""
    return drafter.admission_kv_bytes_per_token(request) if drafter is not None else 0


def request_refusal(request: Any) -> str | None:
    """Why the request itself is served without the draft (None: it can be).
    Log-probabilities are refused because a (k+1)-token forward's values
    differ from a one-token forward's in the last bits, which reported numbers
    show; a grammar and the request's own processors (a forced reply start)
    keep state the verification could run ahead of."""
    if request.params.logprobs:
        return REFUSED_LOGPROBS
    if request.params.grammar is not None:
        return REFUSED_GRAMMAR
    if request.logits_processors:
        return REFUSED_REQUEST_PROCESSORS
    return None


def refusal(request: Any, target_cache: Sequence[Any], *, paged: bool) -> str | None:
    """Why the plain loop serves this request (None: speculation serves it):
    the request's own reasons, then paged KV and caches that cannot trim."""
    reason = request_refusal(request)
    if reason is not None:
        return reason
    if paged:
        return REFUSED_PAGED_KV
    if not all(_layer_trimmable(cache) for cache in target_cache):
        return REFUSED_UNTRIMMABLE
    return None


def _layers(caches: Sequence[Any]) -> list[Any]:
    flat: list[Any] = []
    for cache in caches:
        if isinstance(cache, mlx_cache.CacheList):
            flat.extend(_layers(cache.caches))
        else:
            flat.append(cache)
    return flat


def _layer_trimmable(cache: Any) -> bool:
    return all(type(layer) is not mlx_cache.ArraysCache and layer.is_trimmable() for layer in _layers([cache]))


def trim_room(caches: Sequence[Any], kept_tokens: int) -> int:
    """How many tokens these caches can take after `kept_tokens` more (never
    trimmed) and then give back soundly: a ring must stay below its wrap, and
    a chunked cache inside the chunk it is in now (its front must not move
    past rows a plain step would still attend to). Negative: none."""
    room = _UNBOUNDED
    for layer in _layers(caches):
        if type(layer) is mlx_cache.RotatingKVCache:
            room = min(room, layer.max_size - 1 - layer.offset - kept_tokens)
        elif type(layer) is mlx_cache.ChunkedKVCache:
            chunk_end = (layer.offset // layer.chunk_size + 1) * layer.chunk_size
            room = min(room, chunk_end - layer.offset - kept_tokens)
    return room


def prepare_draft(
    drafter: Drafter,
    split: SplitEntry,
    prompt: Sequence[int],
    cached_tokens: int,
    prefill_step_tokens: int = PREFILL_STEP_TOKENS,
) -> list[Any]:
    """The draft's caches covering all of `prompt`: the companion state the
    tiers lent with the target's first `cached_tokens` when it is the serving
    drafter's, else fresh ones re-prefilled over those tokens too (counted)."""
    draft = split.draft
    usable = draft is not None and all(
        getattr(layer, "offset", cached_tokens) == cached_tokens for layer in _layers(draft)
    )
    if cached_tokens > 0:
        drafter.stats.count_companion("" if usable else (split.reason or "companion_unusable"), cached_tokens)
    if draft is None or not usable:
        draft, draft_tokens = make_prompt_cache(drafter.model), 0
    else:
        draft_tokens = cached_tokens
    if len(prompt) > draft_tokens:
        mx.eval(prefill(drafter.model, prompt[draft_tokens:], draft, prefill_step_tokens))
    return draft


class SpeculativeRounds:
    """One generation's rounds. `covered` is every token the target's caches
    hold (the prompt and the tokens fed since); the draft's hold its first
    `draft_tokens`."""

    def __init__(
        self,
        model: Any,
        drafter: Drafter,
        target: list[Any],
        draft: list[Any],
        sampling: SerialSampling,
        covered: Sequence[int],
    ) -> None:
        self.model, self.drafter, self.target, self.draft, self.sampling = model, drafter, target, draft, sampling
        self.covered = list(covered)
        self.draft_tokens = len(self.covered)

    def _round_size(self) -> int:
        """k: the target keeps p and may give back all k proposals; the draft
        keeps its lag and p and may give back its k - 1 fed proposals."""
        lag = len(self.covered) - self.draft_tokens
        target_room = trim_room(self.target, 1)
        draft_room = max(trim_room(self.draft, lag + 1), 0) + 1
        return max(0, min(self.drafter.num_draft_tokens, target_room, draft_room))

    def round(self, pending: int) -> list[int]:
        """Run `pending` and a round of proposals; returns the tokens emitted
        (at least one), the last of them the next pending token. The caches
        then cover `pending` and every emitted token before the last."""
        k = self._round_size()
        if k == 0:
            logits = self.model(mx.array([[pending]]), cache=self.target)[:, -1, :]
            token, _ = self.sampling.sample(logits)
            self.covered.append(pending)
            return [item_int(token)]
        started_s = time.perf_counter()
        proposals = self._propose(pending, k)
        drafted_s = time.perf_counter()
        verify = self.model(mx.array([[pending, *proposals]]), cache=self.target)
        emitted: list[int] = []
        for position in range(k + 1):
            token, _ = self.sampling.sample(verify[:, position, :])
            emitted.append(item_int(token))
            if position == k or emitted[-1] != proposals[position]:
                break
        accepted = len(emitted) - 1
        self.covered.extend([pending, *emitted[:-1]])
        trim_prompt_cache(self.target, k - accepted)
        self._trim_draft()
        verify_s = time.perf_counter() - drafted_s
        self.drafter.stats.count_round(k, accepted, len(emitted), drafted_s - started_s, verify_s)
        return emitted

    def _propose(self, pending: int, k: int) -> list[int]:
        """The draft's k greedy proposals after its lag and `pending`."""
        fed = [*self.covered[self.draft_tokens :], pending]
        logits = self.drafter.model(mx.array([fed]), cache=self.draft)[:, -1, :]
        proposals = [mx.argmax(logits, axis=-1)]
        for _ in range(k - 1):
            logits = self.drafter.model(proposals[-1].reshape(1, 1), cache=self.draft)[:, -1, :]
            proposals.append(mx.argmax(logits, axis=-1))
        self.draft_tokens += len(fed) + k - 1
        mx.eval(proposals)
        return [item_int(token) for token in proposals]

    def _trim_draft(self) -> None:
        excess = self.draft_tokens - len(self.covered)
        if excess > 0:
            trim_prompt_cache(self.draft, excess)
            self.draft_tokens -= excess

    def cut(self, tokens: int) -> None:
        """The caller stopped `tokens` emitted tokens before a round's last:
        the caches give back what they ran past the last emitted token."""
        if tokens <= 0:
            return
        trim_prompt_cache(self.target, tokens)
        del self.covered[-tokens:]
        self._trim_draft()

    def settle(self) -> None:
        """After a failure mid-round: both caches back to at most `covered`."""
        offset = max((layer.offset for layer in _layers(self.target) if hasattr(layer, "offset")), default=0)
        if offset > len(self.covered):
            trim_prompt_cache(self.target, offset - len(self.covered))
        self._trim_draft()

    def synced_draft(self) -> list[Any]:
        """The draft's caches over exactly `covered` (its lag run first)."""
        lag = self.covered[self.draft_tokens :]
        if lag:
            # Rounds of k = 0 (a ring near its wrap) leave the draft behind: one prefill catches it up.
            prefill(self.drafter.model, lag, self.draft)
            self.draft_tokens += len(lag)
        mx.eval([layer.state for layer in _layers(self.draft)])
        return self.draft


def load_drafter(draft_dir: Path, num_draft_tokens: int, target: Any, memo: Any = None) -> Drafter:
    """The draft model in `draft_dir`, loaded on the engine thread beside the
    `target` (a `LoadedModel`), computing in the target's dtype. Refuses
    (`UsageError`) a draft whose tokenizer is not the target's (the ids must
    mean the same tokens) or whose caches cannot trim (recurrent state):
    speculation trims the draft back after every round. `memo`: the shard
    digest memo the target's fingerprint uses (None: one in RAM)."""
    from kvcellar.engine.attention_window import load_model_and_tokenizer
    from kvcellar.store.fingerprint import ShardDigestMemo, compute_fingerprint

    if num_draft_tokens < 1:
        raise UsageError("--num-draft-tokens must be at least 1")
    try:
        model, tokenizer = load_model_and_tokenizer(draft_dir)
    except Exception as e:
        raise ModelError(f"cannot load the draft model in {draft_dir}: {e}") from e
    if tokenizer.vocab_size != target.tokenizer.vocab_size or tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise UsageError(f"the draft model in {draft_dir} has another tokenizer than the target: its ids differ")
    if target.compute.cast_to is not None:
        model.set_dtype(getattr(mx, target.compute.cast_to))
        mx.eval(model.parameters())
    if not all(_layer_trimmable(cache) for cache in make_prompt_cache(model)):
        raise UsageError(f"the draft model in {draft_dir} keeps recurrent state, which a rejected draft cannot trim")
    # The cast the draft computes in is part of its identity, as the target's is of its fingerprint.
    fingerprint = compute_fingerprint(
        draft_dir,
        kv_scheme_key=f"draft:{target.compute.cast_to or 'model'}",
        memo=memo if memo is not None else ShardDigestMemo(None),
    )
    return Drafter(
        model=model,
        model_dir=draft_dir,
        num_draft_tokens=num_draft_tokens,
        digest=fingerprint.digest,
        kv_bytes_per_token=KvScheme.bf16().projected_bytes(warm_up_prototype_caches(model), 1),
    )


async def open_drafter(engine: Any, config: Any) -> Drafter | None:
    """`--draft-model`'s drafter (`config`: a `SystemConfig`), loaded on the
    engine thread (an `EngineThread`) beside the target; None without one."""
    draft_dir = config.draft_model_dir
    if draft_dir is None:
        return None
    drafter = await engine.call(
        lambda loaded: load_drafter(draft_dir, config.num_draft_tokens, loaded, config.shard_digest_memo),
        label="load-draft",
    )
    log.info("draft model %s: %d tokens per round, drafter %s", draft_dir, drafter.num_draft_tokens, drafter.digest)
    return drafter
