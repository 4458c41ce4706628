"""What went wrong while serving, independent of any API's error shape.

`classify_failure(error)` names whose fault an error is and the status it
answers with; each API shapes the same `Failure` into its own body (OpenAI's
`{"error": {"message", "type", "param", "code"}}` in http/app.py, Anthropic's
`{"type": "error", "error": {"type", "message"}}` in http/anthropic.py), so
the mapping lives here once. Nothing the server can name is a 500: a
`BadRequest` or `UsageError` is the client's (400, naming its field when it
has one), a model the server does not serve a 404 naming the served ones; a
request the server cannot take now (shutting down, its batch aborted, the
engine stopped, the store's disk failing) is unavailable (503;
retry later or elsewhere); a request the memory budget cannot take is
`insufficient_memory` (503, with the numbers in `details`); only an error
kvcellar cannot name is a 500, and it is logged with its traceback.
"""

from __future__ import annotations

import logging
from typing import Literal

import attrs

from kvcellar.errors import (
    AdmissionClosed,
    BadRequest,
    BatchAborted,
    EngineStopped,
    InsufficientMemory,
    KvCellarError,
    StoreError,
    UnknownModel,
    UsageError,
)

log = logging.getLogger("kvcellar.http")

FailureKind = Literal["invalid_request", "not_found", "unavailable", "server", "insufficient_memory"]

# Checked in order.
_CLIENT_ERRORS = (BadRequest, UsageError)
_UNAVAILABLE_ERRORS = (AdmissionClosed, BatchAborted, EngineStopped, StoreError)


@attrs.frozen(kw_only=True)
class Failure:
    """`status` is the HTTP status the OpenAI-compatible routes answer with."""

    kind: FailureKind
    status: int
    message: str
    param: str | None = None
    # Numbers the error body carries beside its message (insufficient_memory's bytes).
    details: dict[str, int] = attrs.field(factory=dict)
    # A machine-readable code where the error has one (`context_length_exceeded`, as OpenAI's own).
    code: str | None = None


def classify_failure(error: Exception) -> Failure:
    """Whose fault `error` is; logs what is not the client's."""
    if isinstance(error, UnknownModel):
        # A model this server does not serve: 404, as OpenAI's and Anthropic's own APIs answer it.
        return Failure(kind="not_found", status=404, message=str(error), param="model", code=error.code)
    if isinstance(error, _CLIENT_ERRORS):
        return Failure(
            kind="invalid_request",
            status=400,
            message=str(error),
            param=getattr(error, "param", None),
            code=getattr(error, "code", None),
        )
    if isinstance(error, InsufficientMemory):
        log.warning("request refused, answered 503: %s", error)
        return Failure(kind="insufficient_memory", status=503, message=str(error), details=error.details())
    if isinstance(error, _UNAVAILABLE_ERRORS):
        log.warning("request failed, answered 503: %s: %s", type(error).__name__, error)
        return Failure(kind="unavailable", status=503, message=str(error))
    if isinstance(error, KvCellarError):
        log.error("request failed on a kvcellar error: %s: %s", type(error).__name__, error, exc_info=error)
        return Failure(kind="server", status=500, message=f"{type(error).__name__}: {error}")
    log.error("request failed on an unexpected error", exc_info=error)
    return Failure(kind="server", status=500, message=f"internal error ({type(error).__name__}); see the server log")
