"""The outermost ASGI layer: the API key (401), the body's content type (415) and its size limit (413)."""

from __future__ import annotations

import hmac

from pydantic import BaseModel

from polyrunner.tools.serve import protocol as P

OPEN_PATHS = frozenset({"/health", "/metrics"})   # answered without the API key


class Guard:
    """Outermost ASGI layer: the API key (401), a JSON content type on every body
    (415: a form or text/plain body, which a web page may send cross-origin
    without a CORS preflight, is never parsed) and the request-body size limit
    (413). It buffers a POST body (up to the limit) and replays it to the app;
    later receives go to the server, so the app still sees the client disconnect."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                err = P.RequestError("Incorrect API key provided.", None, 401, "invalid_api_key")
                await send_json(send, 401, err.response(), {"WWW-Authenticate": "Bearer"})
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if not is_json(headers.get(b"content-type", b"")):
            err = P.RequestError("Unsupported Media Type: Only 'application/json' is allowed", None, 415,
                                 "unsupported_media_type")
            await send_json(send, 415, err.response())
            return
        length = headers.get(b"content-length")
        too_big = P.RequestError(f"the request body exceeds the limit of {self.max_body_bytes} bytes",
                                 None, 413, "request_too_large")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await send_json(send, 413, too_big.response())
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await send_json(send, 413, too_big.response())
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def is_json(content_type: bytes) -> bool:
    """`application/json` or `application/<anything>+json`, with any parameters (charset=...)."""
    media = content_type.split(b";", 1)[0].strip().lower()
    kind, _, subtype = media.partition(b"/")
    return kind == b"application" and (subtype == b"json" or subtype.endswith(b"+json"))


async def send_json(send, status: int, body: BaseModel, headers: dict[str, str] | None = None) -> None:
    raw = body.model_dump_json().encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw, "more_body": False})
