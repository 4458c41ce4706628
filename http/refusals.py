"""Refusals sent before the request's body is read (both APIs' authentication checks)."""

from __future__ import annotations

from starlette.responses import Response


def refused_unread(response: Response) -> Response:
    """`response` with `Connection: close`, for a refusal sent without reading the request's body
    (an unauthenticated body is not read). The server then closes the connection, since the unread
    body is still on it; without the header a keep-alive client could send its next request on
    that connection as it closes and see it dropped with no reply."""
    response.headers["connection"] = "close"
    return response
