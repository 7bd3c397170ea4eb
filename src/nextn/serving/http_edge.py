"""The HTTP edge of `nextn serve`: the API key, the request-body size limit, and JSON parsing with named errors.

Everything here runs before a request reaches the routes' logic, and every refusal is an `APIError` (OpenAI's error
body). The order, outermost first: the API key (`ApiKeyMiddleware`, 401, every path but /health), then for POST
routes `read_body` (the body size: 413 before reading more than the limit) and `parse_json` (UTF-8, JSON syntax,
nesting depth, lone surrogates: 400, each naming where the problem is and the fix). The server parses a large body
off the event loop (OFFLOAD_BYTES), so /health and the other requests stay responsive. The API key follows
vLLM's `--api-key` and llama.cpp's `llama-server --api-key`: `Authorization: Bearer <key>`, compared in constant
time.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re

from starlette.requests import ClientDisconnect, Request

from nextn.serving.openai_protocol import APIError, short

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # 16 MiB: far above any prompt that fits a context (see RELIABILITY.md)
MAX_JSON_DEPTH = 32  # the deepest real request (chat: body → messages → message → content → part) is 5
DRAIN_FACTOR = 8  # an oversized body of up to 8× the limit is read and dropped so the client sees the 413
OFFLOAD_BYTES = 256 * 2**10  # bodies larger than this are parsed and validated in a worker thread
PUBLIC_PATHS = frozenset({"/health"})  # answered without the API key (load balancers' probes)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _too_large(limit: int, size: str) -> APIError:
    return APIError(413, f"the request body is {size}; this server takes at most {limit} bytes: shorten the prompt "
                    "(it must fit max_seq_len tokens anyway) or restart the server with a larger --max_request_bytes",
                    code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than `limit` bytes before reading them.

    Raises:
        APIError: 413 when Content-Length or the bytes received exceed `limit`, 400 for a bad Content-Length.
    """
    try:
        return await _read_body(request, limit)
    except ClientDisconnect:  # nobody is left to read the answer; ends the request quietly
        raise APIError(400, "the client disconnected before sending the whole body") from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise APIError(400, f"Content-Length {short(declared)} is not a byte count", code="invalid_request")
    size = None if declared is None else int(declared) if len(declared) < 19 else 2**63
    if size is not None and size > limit:
        if size <= DRAIN_FACTOR * limit:  # read and drop it, so that the client reads the 413
            async for _ in request.stream():
                pass
        raise _too_large(limit, f"{short(declared)} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked body: counted as it arrives
        size += len(chunk)
        if size > DRAIN_FACTOR * limit:
            break
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise _too_large(limit, f"more than {limit} bytes")
    return b"".join(chunks)


def _depth(obj: object) -> int:
    """Nesting depth of `obj` (0 for a scalar), counted level by level; stops past MAX_JSON_DEPTH."""
    depth, level = 0, [obj] if isinstance(obj, (list, dict)) else []
    while level and depth <= MAX_JSON_DEPTH:
        depth += 1
        level = [x for node in level for x in (node.values() if isinstance(node, dict) else node)
                 if type(x) is list or type(x) is dict]
    return depth


def _surrogate_path(obj: object, path: str = "") -> str | None:
    """Where the first string or key holding a lone surrogate is in `obj` (e.g. "messages[0].content"), or None."""
    if isinstance(obj, str):
        return None if _encodable(obj) else path or "the body"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        where = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{short(k)}" if path else short(k)
        if isinstance(k, str) and not _encodable(k):
            return f"the key {where}"
        if (found := _surrogate_path(v, where)) is not None:
            return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_json(body: bytes) -> object:
    """The JSON value of a request body.

    Raises:
        APIError: 400 naming the problem: empty body, invalid UTF-8 (with the byte offset), malformed JSON (with
            line and column), NaN/Infinity literals, nesting deeper than MAX_JSON_DEPTH, a number too long to
            convert, or a string holding a lone UTF-16 surrogate (with its field).
    """
    if not body.strip():
        raise APIError(400, "the request body is empty: send one JSON object with the request's fields",
                       code="invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start}: {body[e.start:e.start + 4]!r}): "
                       "encode the JSON body as UTF-8", code="invalid_encoding") from None

    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON: numbers must be finite")
    try:
        obj = json.loads(text, parse_constant=no_constant)
    except RecursionError:
        obj, deep = None, True
    except json.JSONDecodeError as e:
        raise APIError(400, f"malformed JSON body ({e.msg} at line {e.lineno} column {e.colno}): send one JSON "
                       "object", code="invalid_json") from None
    except ValueError as e:  # NaN/Infinity, an integer longer than Python converts (4300 digits)
        raise APIError(400, f"malformed JSON body ({e}): send one JSON object with finite numbers",
                       code="invalid_json") from None
    else:
        deep = _depth(obj) > MAX_JSON_DEPTH
    if deep:
        raise APIError(400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels: no request field needs "
                       "that; send the fields of the API reference", code="invalid_json")
    if _SURROGATE_ESCAPE.search(body):  # only an escape makes a surrogate (raw ones are invalid UTF-8)
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            bad = _surrogate_path(obj) or "the body"
            raise APIError(400, f"{bad} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its "
                           "pair), which is not valid Unicode: send real characters",
                           None if bad.startswith("the ") else bad.split(".")[0].split("[")[0],
                           "invalid_encoding") from None
    return obj


class ApiKeyMiddleware:
    """ASGI middleware: every HTTP path but PUBLIC_PATHS needs `Authorization: Bearer <api_key>` (else 401).

    The key is compared with `hmac.compare_digest` (time independent of where the first difference is).
    """

    def __init__(self, app, api_key: str) -> None:
        if not api_key:
            raise ValueError("the API key is empty: pass a non-empty --api_key, or none to serve without one")
        self.app, self.key = app, api_key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS and not self._authorized(scope):
            response = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with "
                                "the key this server was started with (--api_key or NEXTN_API_KEY)",
                                code="invalid_api_key").response(headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        return hmac.compare_digest(token.strip(), self.key) and scheme.lower() == b"bearer"


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to any interface
