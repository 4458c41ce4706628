"""The one error hierarchy of kvcellar.

Every error kvcellar raises on purpose derives from `KvCellarError`. Errors of
libraries (OSError, cbor2, MLX) are converted at the boundary with
`raise ... from e`, so a caller handles one family. Each docstring says when
the error is raised and whose fault it is.
"""

from __future__ import annotations


class KvCellarError(Exception):
    """Root of every error kvcellar raises on purpose."""


class UsageError(KvCellarError):
    """Raised when a caller passes an argument kvcellar cannot act on
    (an unknown architecture, a missing directory). The caller's fault."""


class PromptTooLong(UsageError):
    """Raised when a request's prompt alone fills the model's context, leaving
    no room for one reply token. The client's fault: each API answers it as a
    400 in its own words (Anthropic's `prompt is too long: N tokens > M
    maximum`, which Claude Code answers by compacting; OpenAI's code
    `context_length_exceeded`)."""

    code = "context_length_exceeded"

    def __init__(self, *, prompt_tokens: int, context_tokens_max: int, param: str) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_tokens_max = context_tokens_max
        # A reply needs one token, so the longest prompt served is one short of the context.
        self.prompt_tokens_max = context_tokens_max - 1
        self.param = param
        super().__init__(
            f"This model's maximum context length is {context_tokens_max} tokens, and the prompt alone is "
            f"{prompt_tokens} tokens, which leaves no room for a reply: shorten the prompt to at most "
            f"{self.prompt_tokens_max} tokens (or compact the conversation)"
        )

    @property
    def anthropic_message(self) -> str:
        """Anthropic's own wording, which Claude Code recognises and answers by compacting."""
        return f"prompt is too long: {self.prompt_tokens} tokens > {self.prompt_tokens_max} maximum"


class HostedToolRefused(UsageError):
    """Raised under `kvcellar serve --hosted-tools reject` for a hosted or
    server tool (OpenAI's `web_search`, Anthropic's `bash_…`) the server
    cannot run. The client's fault; each API answers a 400 naming `param`."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class UnknownCacheKind(KvCellarError):
    """Raised when a cache object of a class kvcellar has no codec for reaches
    signature or persistence code. "Unknown is a bug, not a route": it is
    kvcellar's fault (a new mlx-lm class nobody taught us), never routed around."""


class RefusedCacheKind(KvCellarError):
    """Raised for a cache class kvcellar knows but refuses to reuse or persist,
    such as `ConcatenateKVCache` (its `trim` is unsound) or batched caches that
    must be split per row first. The caller's fault: pick another cache class."""


class StoreError(KvCellarError):
    """Base of errors about stored KV entries (`.kvc` files)."""


class UnsupportedFormat(StoreError):
    """Raised when a file is not a `.kvc` file or carries a format version this
    build cannot read (a file from a newer kvcellar, or a foreign file). Nobody's
    fault at runtime: the entry is skipped or regenerated."""


class CorruptEntry(StoreError):
    """Raised when a `.kvc` file fails a check: truncated, a header or tensor
    checksum mismatch, or an inconsistent header. The disk's or a crash's fault;
    the `part` attribute says which part failed (`preamble`, `header`,
    `tensor <name>`, `size`)."""

    def __init__(self, message: str, *, part: str) -> None:
        super().__init__(message)
        self.part = part


class DiskError(StoreError):
    """Raised when the file system fails an operation kvcellar asked of it
    (ENOSPC, EIO, permission). The environment's fault; the store degrades to
    "not stored" / "no hit" rather than failing a request."""

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class DirectoryLocked(StoreError):
    """Raised at startup when another process already holds the cache
    directory's lock (a second server on the same directory). The operator's
    fault: stop the other server or pick another directory. The message names
    the holder."""


class ModelError(KvCellarError):
    """Raised when a model directory cannot be created or loaded (missing files,
    a config mlx-lm rejects). The operator's fault, or a damaged directory."""


class SharedStoreError(StoreError):
    """Raised by the shared cold tier's object-store boundary when the store
    cannot be reached or answers an error (5xx, throttling, a timeout, a
    broken stream), after botocore's bounded retries. The environment's
    fault; serving goes on without the shared tier for that request or upload."""


class SharedObjectMissing(SharedStoreError):
    """Raised when an object the shared index names is gone from the store (a
    deleted object whose manifest remains, or a manifest deleted since it was
    listed). Nobody's fault at runtime: the index drops it."""


class SharedKeyTaken(SharedStoreError):
    """Raised when a conditional put (`If-None-Match: *`) finds the key already
    written (HTTP 412): another server committed this entry first."""
