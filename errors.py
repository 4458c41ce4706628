"""The one error hierarchy of kvcellar.

Every error kvcellar raises on purpose derives from `KvCellarError`, and every
one of them is defined here, so `http/failures.py` maps them to statuses without
importing the modules that raise them. Errors of libraries (OSError, cbor2, MLX)
are converted at the boundary with `raise ... from e`, so a caller handles one
family. Each docstring says when the error is raised and whose fault it is.

Not errors, yet here too so that every exception class kvcellar defines is in
one place: the crash and stop signals of the simulator, the benchmarks and
the cluster launcher (the last section), which stand for a machine or a
process dying or being told to stop, not for something kvcellar raises on
purpose, and so derive from no `KvCellarError`: no
`except KvCellarError` of the code under test may handle a death as a failure.
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


class KeyFileError(StoreError):
    """Raised when an encryption key file (`kvcellar keygen`, `serve
    --encryption-key-file`) is missing, unreadable or not exactly 32 bytes.
    The operator's fault, found at startup: the server does not start."""


class KeyUnavailable(StoreError):
    """Raised when a sealed `.kvc` entry names a key id the key ring does not
    hold (a missing or wrong `--encryption-key-file`), or when it is read with
    no key ring at all. Nobody's fault at runtime: the SSD tier quarantines the
    file (never deletes it: the right key may come back) and serves cold. The
    `key_id` attribute names the key."""

    def __init__(self, message: str, *, key_id: str) -> None:
        super().__init__(message)
        self.key_id = key_id


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


class DecodeError(KvCellarError):
    """Raised when bytes are not valid CBOR for the expected type: a damaged
    or foreign record. The data's fault; callers convert it to a more specific
    error (`CorruptEntry` for a `.kvc` header)."""


class JournalError(StoreError):
    """Raised when a journal cannot be opened for reading: not a kvcellar
    journal, a schema newer than this build, or a damaged database. The
    environment's fault; the server itself degrades instead of raising."""


# -- the engine thread --------------------------------------------------------


class EngineStopped(KvCellarError):
    """Raised when a job is submitted to an engine that has shut down. The
    server's fault (a request raced shutdown); the request fails cleanly."""


class PrefillCancelled(KvCellarError):
    """Raised on the engine thread, between two prefill chunks, when the
    request's client has gone (issue 38): the prefill stops there. Nobody's
    fault; the generation catches it, keeps the `tokens_done` prompt tokens its
    caches hold in the tiers, and ends without a token."""

    def __init__(self, message: str, *, tokens_done: int) -> None:
        super().__init__(message)
        self.tokens_done = tokens_done


class InsufficientMemory(KvCellarError):
    """Raised when a request cannot fit the memory budget even after every
    reclaimable cache entry is released (at admission, or at a relief check
    mid-generation). Nobody's fault: the request is too large for this
    server's budget now; the server and the other requests go on."""

    def __init__(self, message: str, *, needed_bytes: int, available_bytes: int, budget_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.budget_bytes = budget_bytes

    def details(self) -> dict[str, int]:
        return {
            "needed_bytes": self.needed_bytes,
            "available_bytes": self.available_bytes,
            "budget_bytes": self.budget_bytes,
        }


class PagedPoolExhausted(KvCellarError):
    """Raised when a request's block pool has no free block for a write. A
    tripwire: the pool is sized from the request's prompt plus `max_tokens`,
    so this is kvcellar's accounting bug, never a truncation to route around."""


class PagedLayoutError(KvCellarError):
    """Raised when the batch lane asks a paged batch for a layout operation
    mlx-lm's `BatchGenerator` never uses (left padding of an empty batch);
    kvcellar's fault if it ever fires."""


class GrammarError(KvCellarError):
    """A `response_format` llguidance cannot compile, or a grammar the
    generation could not follow (the matcher reported an error)."""


# -- the actors ---------------------------------------------------------------


class IllegalTransition(KvCellarError):
    """Raised by a core when a message arrives in a state that does not
    accept it. kvcellar's fault (a protocol bug between actors)."""


class AdmissionClosed(KvCellarError):
    """Raised to a request that arrives after shutdown began. Nobody's fault;
    the client should retry elsewhere or later (HTTP 503)."""


class RoomRefused(AdmissionClosed):
    """Raised by the model pool when a model cannot be loaded now: the memory budget is held by pinned or
    busy models, or the model to unload could not be drained durably (HTTP 503; retry later)."""


class BatchAborted(KvCellarError):
    """Raised to a batch row whose batch job ended before the row did: an MLX
    error in the job (it fails every row of that batch) or the engine stopping.
    kvcellar's or the environment's fault; the request fails, later requests
    start a new batch."""


# -- the HTTP APIs ------------------------------------------------------------


class BadRequest(KvCellarError):
    """Raised for a request body the API cannot serve. The client's fault; it
    becomes a 400 naming the offending field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BadNamespace(UsageError):
    """A tenant name or `cache_salt` that cannot name a cache namespace
    (`store.namespaces`); the message names the rule."""


class TenantsFileError(UsageError):
    """Raised at start-up for a `serve --tenants` file that cannot be used: it
    names the file, what is wrong and how to fix it, and never a key."""


class ModelsFileError(UsageError):
    """Raised at start-up for `serve --model NAME=DIR` or a `serve --models` file that cannot be used:
    it names the file or flag, what is wrong and how to fix it."""


class UnknownModel(BadRequest):
    """Raised for a request naming a model this server does not serve (no name, alias or default
    matches). A 404 in each API's shape, naming the served models (`served`)."""

    def __init__(self, message: str, *, served: tuple[str, ...]) -> None:
        super().__init__(message, param="model")
        self.served = served
        self.code = "model_not_found"


class PromptRefused(UsageError):
    """Raised when the messages or tools cannot be rendered for this model:
    tools for a model without tool calling, or a chat template that refuses
    the messages. The client's fault; each API answers it as a 400 naming
    `param`."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class StrictToolsRefused(GrammarError):
    """A `strict: true` tool whose schema llguidance cannot compile (the client asked for the guarantee)."""


class BadQuery(KvCellarError):
    """Raised for a dashboard query parameter that is not an integer in its
    range (`?limit=`, `?after_seq=`). The client's fault; a 400 naming
    `param`."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


# -- the simulator ------------------------------------------------------------


class DeterminismUnavailable(KvCellarError):
    """Raised when the installed Trio lacks the scheduler hooks the simulator
    seeds (a Trio other than the pinned one). The environment's fault."""


# -- crash signals: not errors, so not `KvCellarError`s -----------------------


class SimulatedCrash(BaseException):
    """The simulated machine died at a crash point (`simulations/sim_disk.py`).
    A `BaseException`, so the store's `except Exception` handlers cannot
    swallow it."""


class SimulatedStoreCrash(Exception):
    """The writer died at this object-store call: the call never happened
    (`simulations/shared_store.py`'s in-memory object store)."""


class BenchProcessCrash(Exception):
    """Raised inside `open_system` by a benchmark (`bench/ssd_wear.py`) to end
    a process life without its shutdown flush."""


class StopRequested(BaseException):
    """Ctrl-C or SIGTERM while `kvcellar cluster` was starting (http/cluster.py):
    a `BaseException`, like `KeyboardInterrupt`, so no `except Exception` takes it."""
