"""What every API's replies share about time and departure (issue 38, items 3
and 4): a stream never looks dead, and a client that leaves stops its work.

Keep-alives. `KeepAliveStreamingResponse` is Starlette's `StreamingResponse`
whose body is read by a child task: whenever the body has sent nothing for
`interval_s` (a long prefill, a wait for the lane), the response writes the
API's keep-alive instead, an Anthropic `ping` event or an SSE comment line
(`: keep-alive`) on the OpenAI APIs. Clients skip both (the SSE rule for
comments; Anthropic's SDKs read `ping` as nothing). The default interval,
`KEEPALIVE_INTERVAL_S_DEFAULT`, leaves a client with a 10 s idle timer two
chances; `kvcellar serve --keepalive-interval` sets it.

Departures. A streaming reply's client going away cancels its body (Starlette
listens for `http.disconnect` beside the stream under hypercorn's ASGI 2.1);
`unless_client_leaves` does the same for a reply that is not streamed: it
watches the request's `receive` for hypercorn's `http.disconnect` while the
reply is computed and cancels the computation when it comes. Either way the
generation's stream is closed, its `cancelled` flag set, and the engine stops
it within one step (engine/generation.py, engine/batch.py), keeping the
prefix computed so far.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import trio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Send

KEEPALIVE_INTERVAL_S_DEFAULT = 5.0
# An SSE comment: every SSE reader skips it (the OpenAI APIs).
SSE_COMMENT_KEEPALIVE = ": keep-alive\n\n"
# The Anthropic Messages stream's own keep-alive event.
ANTHROPIC_PING_KEEPALIVE = 'event: ping\ndata: {"type": "ping"}\n\n'
# The status a reply whose client left is given; nobody reads it (nginx's "client closed request").
CLIENT_CLOSED_STATUS = 499


class KeepAliveStreamingResponse(StreamingResponse):
    """A `StreamingResponse` that writes `keepalive` whenever its body has
    been silent for `interval_s` seconds."""

    def __init__(
        self,
        content: object,
        *,
        keepalive: str,
        interval_s: float,
        media_type: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)  # type: ignore[arg-type]
        self.keepalive = keepalive.encode()
        self.interval_s = interval_s

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        chunks_in, chunks = trio.open_memory_channel[bytes](0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_body, chunks_in)
            async with chunks:
                while True:
                    chunk = self.keepalive
                    with trio.move_on_after(self.interval_s):
                        try:
                            chunk = await chunks.receive()
                        except trio.EndOfChannel:
                            break
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _read_body(self, chunks_in: trio.MemorySendChannel[bytes]) -> None:
        """Forward the body's chunks; closing it here, whatever happens, ends
        its generation (the client-gone path) on this task."""
        body = self.body_iterator
        try:
            async with chunks_in:
                async for chunk in body:
                    await chunks_in.send(chunk.encode(self.charset) if isinstance(chunk, str) else bytes(chunk))
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()


async def unless_client_leaves(request: Request, reply: Callable[[], Awaitable[Response]]) -> Response:
    """`await reply()`, cancelled if the client disconnects first (hypercorn's
    `http.disconnect`; the request's body must have been read). The reply of a
    client that left is an empty `CLIENT_CLOSED_STATUS` nobody receives."""
    response: Response = Response(status_code=CLIENT_CLOSED_STATUS)
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        response = await reply()
        nursery.cancel_scope.cancel()
    return response
