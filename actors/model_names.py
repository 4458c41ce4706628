"""The model pool's names (issue 41): which served model a request's `model` field means.

Pure: no trio, no MLX, no I/O but `load_models_file`'s one read. A pool is given as
`serve --model NAME=DIR|ORG/NAME` (repeatable) or `serve --models FILE`, a TOML file:

    default = "coder"                 # optional: the model an unmatched name falls back to

    [models.coder]
    path = "/models/demo-coder"       # a local mlx-lm directory or a hub repo id ORG/NAME
    aliases = ["claude-*", "gpt-*"]   # optional: exact names or fnmatch globs
    pin = true                        # optional: never unloaded under memory pressure
    kv_quant = "8"                    # optional: this model's KV scheme (else serve's --kv-quant)
    ram_gb = 2.0                      # optional: this model's fixed RAM prompt-cache share (GB)
    draft_model = "/models/draft"     # optional: speculative decoding's draft (same forms as path)
    num_draft_tokens = 4              # optional, with draft_model (else serve's --num-draft-tokens)

    [models.small]
    path = "/models/llama-tiny"
    aliases = ["claude-haiku-*"]

Resolution (`ModelNames.resolve`), one rule for every API: a model's exact name first, then
each model's aliases in file order (the first model, and within it the first alias, that
matches wins, so `claude-haiku-*` must come before `claude-*` when both are given), then the
default model when one is configured; otherwise `UnknownModel` (a 404 naming the served
models). A request without a model field means the default, else the first model.
"""

from __future__ import annotations

import fnmatch
import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kvcellar.errors import ModelsFileError, UnknownModel

MODEL_FIELDS = frozenset({"path", "aliases", "pin", "kv_quant", "ram_gb", "draft_model", "num_draft_tokens"})
FILE_FIELDS = frozenset({"default", "models"})
# A model's name: what `GET /v1/models` lists and the `model` a reply names.
MODEL_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")


@attrs.frozen(kw_only=True)
class ModelSpec:
    """One served model: its name, where its weights are (a directory or a hub repo id, resolved
    by the CLI), its aliases (exact names or globs), whether it is pinned, its KV scheme (None: serve's),
    its fixed RAM prompt-cache share (None: a share by use), and its speculative draft (a directory or a
    hub repo id like `source`; None: no draft) with its tokens per round (None: serve's)."""

    name: str
    source: str
    aliases: tuple[str, ...] = ()
    pin: bool = False
    kv_quant: str | None = None
    ram_gb: float | None = None
    draft_source: str | None = None
    num_draft_tokens: int | None = None


@attrs.frozen(kw_only=True)
class ModelNames:
    """The served models in their configured order and the default (None: an unmatched name is a 404)."""

    models: tuple[ModelSpec, ...]
    default: str | None = None

    def __attrs_post_init__(self) -> None:
        names = [model.name for model in self.models]
        if not names:
            raise ModelsFileError("a model pool needs at least one model")
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ModelsFileError(f"model names must be unique: {', '.join(duplicates)} given twice")
        if self.default is not None and self.default not in names:
            raise ModelsFileError(f"the default model {self.default!r} is not one of the models ({', '.join(names)})")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(model.name for model in self.models)

    def spec(self, name: str) -> ModelSpec:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(name)

    def resolve(self, requested: str | None) -> str:
        """The served model's name for a request's `model` field; `UnknownModel` when none matches."""
        matched = self.match(requested)
        if matched is None:
            raise UnknownModel(
                f"model {requested!r} is not served here: this server serves {', '.join(map(repr, self.names))} "
                "(GET /v1/models lists them and their aliases); set your client's model to one of them",
                served=self.names,
            )
        return matched

    def match(self, requested: str | None) -> str | None:
        """`resolve` without the error: None when nothing matches and there is no default."""
        if requested is None:
            return self.default if self.default is not None else self.models[0].name
        for model in self.models:
            if model.name == requested:
                return model.name
        for model in self.models:
            if any(fnmatch.fnmatchcase(requested, alias) for alias in model.aliases):
                return model.name
        return self.default

    def listing(self) -> list[dict[str, Any]]:
        """`GET /v1/models`' `data`: each model, then each alias naming the model it routes to."""
        data: list[dict[str, Any]] = [
            {"id": model.name, "object": "model", "owned_by": "kvcellar", "aliases": list(model.aliases)}
            for model in self.models
        ]
        for model in self.models:
            data.extend(
                {"id": alias, "object": "model", "owned_by": "kvcellar", "alias_of": model.name}
                for alias in model.aliases
            )
        return data


def parse_model_flag(value: str) -> ModelSpec:
    """One `--model NAME=DIR|ORG/NAME`; a value without `=` is named after its last path part."""
    name, sep, source = value.partition("=")
    if not sep:
        source = value
        name = Path(value.rstrip("/")).name or value
    if not source:
        raise ModelsFileError(f"--model {value!r}: nothing after '='; give NAME=DIR or NAME=ORG/NAME")
    _check_name(name, f"--model {value!r}")
    return ModelSpec(name=name, source=source)


def parse_models_file(text: str, where: str = "the models file") -> ModelNames:
    """A `--models` TOML file's text → `ModelNames`; `ModelsFileError` names the problem and the fix."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ModelsFileError(f"{where} is not valid TOML: {e}") from e
    unknown = sorted(set(document) - FILE_FIELDS)
    if unknown:
        raise ModelsFileError(
            f"{where}: unknown top-level key(s) {', '.join(unknown)}; use 'default' and [models.NAME]"
        )
    tables = document.get("models")
    if not isinstance(tables, Mapping) or not tables:
        raise ModelsFileError(f"{where} names no model: add a [models.NAME] table with a 'path'")
    models = tuple(_model_from_table(name, table, where) for name, table in tables.items())
    default = document.get("default")
    if default is not None and not isinstance(default, str):
        raise ModelsFileError(f"{where}: 'default' must be a model's name (a string)")
    return ModelNames(models=models, default=default)


def load_models_file(path: Path) -> ModelNames:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ModelsFileError(f"cannot read the models file {path}: {e.strerror or e}") from e
    return parse_models_file(text, where=str(path))


def _model_from_table(name: str, table: Any, where: str) -> ModelSpec:
    place = f"{where} [models.{name}]"
    _check_name(name, place)
    if not isinstance(table, Mapping):
        raise ModelsFileError(f"{place} must be a table with a 'path'")
    unknown = sorted(set(table) - MODEL_FIELDS)
    if unknown:
        raise ModelsFileError(f"{place}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(MODEL_FIELDS))}")
    source = table.get("path")
    if not isinstance(source, str) or not source:
        raise ModelsFileError(f"{place} needs 'path': a model directory or a hub repo id ORG/NAME")
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(alias, str) and alias for alias in aliases):
        raise ModelsFileError(f"{place}: 'aliases' must be a list of names or globs (strings)")
    pin = table.get("pin", False)
    if not isinstance(pin, bool):
        raise ModelsFileError(f"{place}: 'pin' must be true or false")
    kv_quant = table.get("kv_quant")
    if kv_quant is not None and not isinstance(kv_quant, str | int):
        raise ModelsFileError(f'{place}: \'kv_quant\' must be like serve\'s --kv-quant ("bf16", "4", "8")')
    draft_source, num_draft_tokens = _draft_fields(table, place)
    return ModelSpec(
        name=name,
        source=source,
        aliases=tuple(aliases),
        pin=pin,
        kv_quant=None if kv_quant is None else str(kv_quant),
        ram_gb=_ram_gb(table, place),
        draft_source=draft_source,
        num_draft_tokens=num_draft_tokens,
    )


def _ram_gb(table: Mapping[str, Any], place: str) -> float | None:
    ram_gb = table.get("ram_gb")
    if ram_gb is None:
        return None
    if isinstance(ram_gb, bool) or not isinstance(ram_gb, int | float) or not math.isfinite(ram_gb) or ram_gb <= 0:
        raise ModelsFileError(
            f"{place}: 'ram_gb' must be a number of GB above 0 (like 2 or 0.5), not {ram_gb!r}; "
            "leave it out for a share of --prompt-cache by use"
        )
    return float(ram_gb)


def _draft_fields(table: Mapping[str, Any], place: str) -> tuple[str | None, int | None]:
    draft_source = table.get("draft_model")
    if draft_source is not None and (not isinstance(draft_source, str) or not draft_source):
        raise ModelsFileError(f"{place}: 'draft_model' must be a model directory or a hub repo id ORG/NAME")
    num_draft_tokens = table.get("num_draft_tokens")
    if num_draft_tokens is None:
        return draft_source, None
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ModelsFileError(f"{place}: 'num_draft_tokens' must be a whole number of tokens, 1 or more")
    if draft_source is None:
        raise ModelsFileError(f"{place}: 'num_draft_tokens' needs 'draft_model' (the draft that proposes them)")
    return draft_source, num_draft_tokens


def _check_name(name: str, place: str) -> None:
    if not MODEL_NAME_PATTERN.fullmatch(name):
        raise ModelsFileError(
            f"{place}: {name!r} is not a usable model name (letters, digits and ._:@/- , at most 128 characters)"
        )
