"""Speculative decoding with companion state (issue 42), in process with real
tiny models: greedy output with a draft is the plain loop's token for token
on every architecture mlx-lm can speculate with, from a cold start and from
the RAM tier's companion state; refusals are counted; a drafter change never
pairs stale draft state."""

from __future__ import annotations

import threading

import pytest
from mlx_lm import load

from kvcellar.engine.demo_models import ARCHITECTURES, create_model
from kvcellar.engine.engine import LoadedModel, SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest, TokenDelta, run_generation
from kvcellar.engine.speculative import (
    REFUSED_LOGPROBS,
    REFUSED_UNTRIMMABLE,
    Drafter,
)
from kvcellar.store.companion import COMPANION_STALE, companion_drafter
from kvcellar.store.fingerprint import compute_fingerprint
from kvcellar.store.prompt_cache import PromptCache
from kvcellar.store.scheme import KvScheme, warm_up_prototype_caches

# Architectures whose every cache trims (mlx-lm's speculative step needs it); the others have recurrent state.
SPECULATING = ("llama", "gemma3_text", "deepseek_v3", "llama4")
RECURRENT = tuple(arch for arch in ARCHITECTURES if arch not in SPECULATING)
PROMPT = tuple(range(5, 45))
GREEDY = SamplingParams(max_tokens=40)
# gemma3_text's tiny sliding window is 32 tokens and a wrapped ring cannot trim: its prompt stays
# short, and its rounds shrink to plain steps as the ring nears the wrap.
PROMPT_TOKENS = {"gemma3_text": 10}


def prompt_for(arch: str) -> tuple[int, ...]:
    return PROMPT[: PROMPT_TOKENS.get(arch, len(PROMPT))]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    root = tmp_path_factory.mktemp("spec-models")
    loaded: dict[str, LoadedModel] = {}
    for arch in ARCHITECTURES:
        model_dir = create_model(arch, root / arch)
        model, tokenizer = load(str(model_dir))
        loaded[arch] = LoadedModel(model=model, tokenizer=tokenizer, model_dir=model_dir, context_tokens_max=4096)
    return loaded


def drafter_for(loaded: LoadedModel, num_draft_tokens: int = 3) -> Drafter:
    digest = compute_fingerprint(loaded.model_dir, device_architecture="test").digest
    return Drafter(model=loaded.model, model_dir=loaded.model_dir, num_draft_tokens=num_draft_tokens, digest=digest)


def generate(
    loaded: LoadedModel,
    prompt_cache: PromptCache | None,
    drafter: Drafter | None,
    prompt=PROMPT,
    params: SamplingParams = GREEDY,
) -> tuple[list[int], GenerationDone]:
    request = GenerationRequest(prompt_ids=tuple(prompt), params=params)
    tokens: list[int] = []
    done = None
    for item in run_generation(loaded, prompt_cache, request, threading.Event(), drafter=drafter):
        if isinstance(item, TokenDelta) and item.token_id >= 0:
            tokens.append(item.token_id)
        elif isinstance(item, GenerationDone):
            done = item
    assert done is not None
    return tokens, done


@pytest.mark.parametrize("arch", SPECULATING)
def test_greedy_output_with_a_self_draft_is_the_plain_output(models, arch):
    loaded, prompt = models[arch], prompt_for(arch)
    plain, _ = generate(loaded, None, None, prompt)
    drafter = drafter_for(loaded)
    drafted, _ = generate(loaded, None, drafter, prompt)
    assert drafted == plain
    stats = drafter.stats.snapshot()
    assert stats["requests"] == 1 and stats["rounds"] > 0
    # A self-draft proposes what the target would sample: everything is accepted.
    assert stats["acceptance_rate"] == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("arch", SPECULATING)
def test_greedy_output_from_the_ram_tiers_companion_state_is_the_plain_output(models, arch):
    loaded, prompt = models[arch], prompt_for(arch)
    params = SamplingParams(max_tokens=8 if arch == "gemma3_text" else 40)
    drafter = drafter_for(loaded)
    tiers = PromptCache()
    first, _ = generate(loaded, tiers, drafter, prompt, params)
    caches = tiers.snapshot_exact(prompt + tuple(first[:-1]))
    assert caches is not None and companion_drafter(caches.caches) == drafter.digest
    follow_up = prompt + tuple(first) + (7, 8, 9)
    plain, _ = generate(loaded, None, None, follow_up, params)
    drafted, done = generate(loaded, tiers, drafter, follow_up, params)
    assert done.cached_tokens > len(prompt) and drafted == plain
    assert drafter.stats.snapshot()["companion_restored"] == 1


def test_a_small_draft_for_another_target_keeps_the_output(models):
    target, draft = models["llama"], models["deepseek_v3"]
    plain, _ = generate(target, None, None)
    drafter = drafter_for(draft, num_draft_tokens=4)
    drafted, _ = generate(target, PromptCache(), drafter)
    assert drafted == plain
    assert drafter.stats.snapshot()["rounds"] > 0


def test_seeded_sampling_with_a_draft_is_the_plain_output(models):
    loaded = models["llama"]
    seeded = SamplingParams(max_tokens=40, temperature=0.8, seed=11, repetition_penalty=1.2)
    plain, _ = generate(loaded, None, None, params=seeded)
    drafted, _ = generate(loaded, None, drafter_for(loaded), params=seeded)
    assert drafted == plain


@pytest.mark.parametrize("arch", RECURRENT)
def test_recurrent_state_falls_back_to_plain_decoding_counted(models, arch):
    loaded = models[arch]
    plain, _ = generate(loaded, None, None)
    drafter = drafter_for(models["llama"])
    drafted, _ = generate(loaded, None, drafter)
    assert drafted == plain
    assert drafter.stats.snapshot()["refused"] == {REFUSED_UNTRIMMABLE: 1}


def test_logprobs_fall_back_counted(models):
    loaded = models["llama"]
    drafter = drafter_for(loaded)
    params = SamplingParams(max_tokens=8, logprobs=True)
    drafted, _ = generate(loaded, None, drafter, params=params)
    assert drafted == generate(loaded, None, None, params=params)[0]
    assert drafter.stats.snapshot()["refused"] == {REFUSED_LOGPROBS: 1}


def test_a_drafter_change_never_pairs_stale_state(models):
    loaded = models["llama"]
    tiers = PromptCache()
    first, _ = generate(loaded, tiers, drafter_for(loaded))
    other = drafter_for(models["deepseek_v3"])
    follow_up = PROMPT + tuple(first) + (7, 8, 9)
    drafted, done = generate(loaded, tiers, other, follow_up)
    assert done.cached_tokens > len(PROMPT)
    assert drafted == generate(loaded, None, None, follow_up)[0]
    stats = other.stats.snapshot()
    assert stats["draft_reprefills"] == {COMPANION_STALE: 1} and stats["companion_restored"] == 0
    entry = tiers.snapshot_exact(follow_up + tuple(drafted[:-1]))
    assert entry is not None and companion_drafter(entry.caches) == other.digest


def test_companion_bytes_are_billed_with_the_target(models):
    loaded = models["llama"]
    with_draft, without = PromptCache(), PromptCache()
    generate(loaded, with_draft, drafter_for(loaded))
    generate(loaded, without, None)
    assert with_draft.stats()["bytes"] == 2 * without.stats()["bytes"]


def test_a_draft_with_recurrent_state_is_refused_at_load(models):
    from kvcellar.engine.speculative import load_drafter
    from kvcellar.errors import UsageError

    with pytest.raises(UsageError, match="recurrent state"):
        load_drafter(models["mamba2"].model_dir, 3, models["llama"])
    drafter = load_drafter(models["deepseek_v3"].model_dir, 2, models["llama"])
    assert drafter.num_draft_tokens == 2 and len(drafter.digest) == 32
    # What the memory guard's admission counts per token of a request the draft serves.
    prototypes = warm_up_prototype_caches(models["deepseek_v3"].model)
    assert drafter.kv_bytes_per_token == KvScheme.bf16().projected_bytes(prototypes, 1) > 0


def test_serve_offers_the_draft_options():
    from click.testing import CliRunner

    from kvcellar.cli.serve import serve_command

    text = CliRunner().invoke(serve_command, ["--help"]).output
    assert "--draft-model" in text and "--num-draft-tokens" in text
