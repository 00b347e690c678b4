"""OpenAI-shaped errors and the middleware that turns every failure into one.

Clients of OpenAI-compatible servers (the ``openai`` package, LangChain, curl scripts) read
``{"error": {"message", "type", "param", "code"}}``; vLLM and SGLang answer in the same shape.
Every 4xx says what was wrong in ``message``; ``param`` names the request field when there is one.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

# The body size limit (server.max_body_bytes), set by build_app, named in 413 messages.
MAX_BODY_BYTES = web.AppKey("pdkv.max_body_bytes", int)

# HTTP status -> OpenAI error type.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client as OpenAI error JSON with ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 503


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500
                                                               else "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(message: str, status: int = 400, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(message, status, param, code), status=status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """APIError and aiohttp's HTTP exceptions (404 route, 405, 413 body too large) become JSON.

    An unexpected exception is logged with its traceback and answered as a 500 that names the
    exception type; the server itself keeps running.
    """
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e.message, e.status, e.param, e.code, e.headers)
    except web.HTTPRequestEntityTooLarge as e:
        limit = request.app.get(MAX_BODY_BYTES)
        msg = f"request body is too large: the limit is {limit} bytes (server.max_body_bytes)" if limit \
            else e.text or "request body is too large"
        return error_response(msg, 413, code="request_too_large")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404:
            msg = f"no route for {request.method} {request.path}"
        elif e.status == 405:
            msg = f"method {request.method} is not allowed on {request.path}"
        else:
            msg = e.reason
        return error_response(msg, e.status, headers={k: v for k, v in e.headers.items() if k == "Allow"})
    except (ConnectionResetError, OSError) as e:
        # The client went away; nothing can be sent. Log quietly and let aiohttp close.
        log.debug("client connection lost on %s: %s", request.path, e)
        raise
    except Exception as e:  # noqa: BLE001 - the server must answer and stay up
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(f"internal server error: {type(e).__name__}: {e}", 500, code="internal_error")
