"""Models from the Hugging Face hub: download (with progress), resolve from the cache, list.

`resolve_hub_model` is what `serve --model ORG/NAME` uses: a repo already in
the local hub cache is used as it is, without a network call; otherwise it is
downloaded with `huggingface_hub.snapshot_download` (only the files mlx-lm
loads, with huggingface_hub's progress bars on stderr), unless the hub is
switched off (`HF_HUB_OFFLINE`), which is then a start-up error that names
the repo and what to do. `HF_ENDPOINT` chooses the hub (tests point it at a
fake on 127.0.0.1); `HF_HOME`/`HF_HUB_CACHE` choose the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from kvcellar.errors import UsageError

# The files `mlx_lm.load` reads (mlx-lm's own download patterns): configs,
# weights, tokenizer files, chat templates and custom model code.
MLX_LM_FILE_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)
OFFLINE_ENV_VAR = "HF_HUB_OFFLINE"
_TRUE_VALUES = {"1", "on", "yes", "true"}


@attrs.frozen(kw_only=True)
class CachedModel:
    """One model repo in the local hub cache."""

    repo_id: str
    size_bytes: int
    files: int
    revisions: int
    path: Path


def is_repo_id(text: str) -> bool:
    """True for the `ORG/NAME` shape of a hub repo id (one slash, both parts non-empty)."""
    org, slash, name = text.partition("/")
    return bool(slash and org and name and "/" not in name and not text.startswith((".", "~")))


def hub_offline(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    return environ.get(OFFLINE_ENV_VAR, "").strip().lower() in _TRUE_VALUES


def cached_model_dir(repo_id: str) -> Path | None:
    """The cached snapshot of `repo_id`'s main revision, or None when it is not (completely) cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(MLX_LM_FILE_PATTERNS), local_files_only=True))
    except LocalEntryNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read the local Hugging Face cache for {repo_id!r}: {e}") from e


def download_model(repo_id: str) -> Path:
    """Download `repo_id` (the files mlx-lm needs) into the hub cache and return its snapshot.

    Progress goes to stderr through huggingface_hub's bars. Raises
    `UsageError` when the hub is switched off, the repo does not exist or is
    gated, or the hub cannot be reached.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if hub_offline():
        raise UsageError(_offline_message(repo_id))
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(MLX_LM_FILE_PATTERNS)))
    except GatedRepoError as e:
        raise UsageError(f"{repo_id!r} is gated on the hub: accept its terms and log in (`hf auth login`)") from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise UsageError(f"{repo_id!r} is not a model repo on the hub (or it is private): check the name") from e
    except LocalEntryNotFoundError as e:
        raise UsageError(
            f"cannot download {repo_id!r}: the hub ({_endpoint()}) is unreachable and the model is not in the "
            f"local cache; connect and retry, or pass a local model directory to --model ({_first_line(e)})"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise UsageError(f"cannot download {repo_id!r} from {_endpoint()}: {_first_line(e)}") from e


def resolve_hub_model(repo_id: str) -> Path:
    """The local directory of `repo_id`: the cached snapshot, else a fresh download."""
    cached = cached_model_dir(repo_id)
    if cached is not None:
        return cached
    return download_model(repo_id)


def list_cached_models() -> list[CachedModel]:
    """Every model repo in the local hub cache, by repo id."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache_info = scan_cache_dir()
    except CacheNotFound:
        return []
    except OSError as e:
        raise UsageError(f"cannot read the local Hugging Face cache: {e}") from e
    models = [
        CachedModel(
            repo_id=repo.repo_id,
            size_bytes=repo.size_on_disk,
            files=repo.nb_files,
            revisions=len(repo.revisions),
            path=Path(repo.repo_path),
        )
        for repo in cache_info.repos
        if repo.repo_type == "model"
    ]
    return sorted(models, key=lambda model: model.repo_id)


def _offline_message(repo_id: str) -> str:
    return (
        f"{repo_id!r} is not in the local Hugging Face cache and {OFFLINE_ENV_VAR} is set, so it cannot be "
        f"downloaded: unset {OFFLINE_ENV_VAR} (or run `kvcellar model pull {repo_id}` while online), "
        "or pass a local model directory to --model"
    )


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
