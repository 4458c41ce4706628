"""`kvcellar serve` with a model pool (issue 41): `--model NAME=DIR` (repeatable) or `--models FILE`.

One `--model` without `NAME=` (or none) is the single-model server, unchanged; this module takes over
only when a pool is asked for. Each model's `SystemConfig` is serve's own with the model's directory and
KV scheme and draft; the RAM prompt cache (`--prompt-cache`) is shared out among the loaded models:
a model's `ram_gb` is its own, the rest goes by use (actors/model_pool_plan.py `ram_shares`). Each model
has its own lanes, `--batch` rows included: its batch job gives the one engine thread back between two
steps while another model waits (engine/shared_engine.py), so a batch whose rows keep coming starves no
other model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from kvcellar.actors.model_names import ModelNames, ModelSpec, load_models_file, parse_model_flag
from kvcellar.actors.model_pool_plan import fixed_shares_fit, ram_shares
from kvcellar.errors import UsageError

if TYPE_CHECKING:
    from kvcellar.actors.model_pool import ModelPool
    from kvcellar.actors.system import SystemConfig

GB = 10**9


def pool_names(models: tuple[str, ...], models_file: Path | None, default: str | None) -> ModelNames | None:
    """The pool the flags ask for, or None for the single-model server (no `--models`, at most one `--model`
    that is a directory or a hub repo id, not `NAME=...`)."""
    if models_file is not None:
        if models:
            raise UsageError("--models FILE and --model cannot be combined: list every model in the file")
        names = load_models_file(models_file)
        if default is not None:
            names = attrs.evolve(names, default=default)
        return names
    pooled = len(models) > 1 or any("=" in value and not Path(value).expanduser().exists() for value in models)
    if not pooled:
        if default is not None:
            raise UsageError("--default-model needs a model pool: --model NAME=DIR (repeatable) or --models FILE")
        return None
    return ModelNames(models=tuple(parse_model_flag(value) for value in models), default=default)


def ram_fixed_bytes(names: ModelNames) -> dict[str, int]:
    """The models file's `ram_gb` shares, in bytes, by model."""
    return {spec.name: int(spec.ram_gb * GB) for spec in names.models if spec.ram_gb is not None}


def pool_configs(
    names: ModelNames, base: SystemConfig, resolve_model_dir: Callable[[str], Path]
) -> dict[str, SystemConfig]:
    """Each model's configuration: serve's, with its directory and draft (`resolve_model_dir`: a hub id is
    resolved now) and KV scheme; its RAM share is its `ram_gb`, else it starts at an equal
    split of what the fixed shares leave of `--prompt-cache`. Fixed shares that do not fit are refused."""
    fixed = ram_fixed_bytes(names)
    if not fixed_shares_fit(fixed, len(names.models), base.prompt_cache_bytes):
        raise UsageError(
            f"the models' ram_gb ({', '.join(f'{n}: {b / GB:g}' for n, b in fixed.items())}) add up to "
            f"{sum(fixed.values()) / GB:g} GB, more than --prompt-cache ({base.prompt_cache_bytes / GB:g} GB) "
            "can give (it must also leave some RAM to any model without ram_gb): "
            "raise --prompt-cache or lower ram_gb"
        )
    # The pool's one share rule, before any model has served a request.
    shares = ram_shares({spec.name: 0 for spec in names.models}, base.prompt_cache_bytes, fixed_bytes=fixed)
    return {spec.name: _model_config(spec, base, resolve_model_dir, shares[spec.name]) for spec in names.models}


def _model_config(
    spec: ModelSpec, base: SystemConfig, resolve_model_dir: Callable[[str], Path], share_bytes: int
) -> SystemConfig:
    draft_source = spec.draft_source
    draft_dir = None if draft_source is None else _resolved(spec, "draft_model", draft_source, resolve_model_dir)
    return attrs.evolve(
        base,
        model_dir=_resolved(spec, "path", spec.source, resolve_model_dir),
        kv_quant=spec.kv_quant if spec.kv_quant is not None else base.kv_quant,
        prompt_cache_bytes=share_bytes,
        draft_model_dir=draft_dir,
        num_draft_tokens=spec.num_draft_tokens if spec.num_draft_tokens is not None else base.num_draft_tokens,
    )


def _resolved(spec: ModelSpec, field: str, source: str, resolve_model_dir: Callable[[str], Path]) -> Path:
    try:
        return resolve_model_dir(source)
    except UsageError as e:
        raise UsageError(
            f"model {spec.name!r}: its {field} {source!r} is not a model directory nor a hub repo id ORG/NAME "
            f"({e}); fix it in the models file or the --model flag"
        ) from e


def make_pool(
    names: ModelNames,
    base: SystemConfig,
    models_memory_gb: float | None,
    resolve_model_dir: Callable[[str], Path],
) -> ModelPool:
    from kvcellar.actors.model_pool import ModelPool
    from kvcellar.engine.memory import default_memory_budget_bytes

    budget = default_memory_budget_bytes() if models_memory_gb is None else int(models_memory_gb * GB)
    return ModelPool(
        names,
        pool_configs(names, base, resolve_model_dir),
        budget_bytes=budget,
        ram_total_bytes=base.prompt_cache_bytes,
        ram_fixed_bytes=ram_fixed_bytes(names),
    )
