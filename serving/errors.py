"""One error contract for every failure of the HTTP service: `{"error": {"type", "message", "field"?}}`.

`ApiError` is what handlers raise; the exception handlers installed by `install` turn it, FastAPI's
request-validation errors, body-parse failures, unknown routes and methods, and any unexpected
exception into that one shape (with the status kept and `Retry-After` where the client should retry).
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ray.serve")

#: status -> error type, for statuses raised without an explicit type
TYPES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "payload_too_large",
         415: "unsupported_media_type", 422: "invalid_request", 429: "rate_limited", 503: "overloaded",
         504: "timeout", 500: "internal"}


class ErrorDetail(BaseModel):
    type: str = Field(description="invalid_request, not_found, method_not_allowed, payload_too_large, "
                                  "unsupported_media_type, overloaded, timeout, internal")
    message: str = Field(description="what went wrong and how to fix it")
    field: str | None = Field(None, description="the request field at fault, e.g. pairs[3][1]")


class ErrorBody(BaseModel):
    error: ErrorDetail


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field
        self.type, self.headers = type or TYPES.get(status, "error"), headers


def error_response(status: int, message: str, field: str | None = None, type: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    detail: dict[str, Any] = {"type": type or TYPES.get(status, "error"), "message": message}
    if field is not None:
        detail["field"] = field
    return JSONResponse(status_code=status, content={"error": detail}, headers=headers)


def _location(loc) -> str:
    """('body', 'pairs', 0, 1) -> 'pairs[0][1]'."""
    out = ""
    for part in loc:
        if part == "body":
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def api_error_response(exc: ApiError) -> JSONResponse:
    """What a handler's ApiError answers, from a FastAPI route or a hot route (serving/hot.py)."""
    return error_response(exc.status, exc.message, exc.field, exc.type, exc.headers)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return api_error_response(exc)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":  # the body is not JSON at all: a parse failure, not a bad field
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return error_response(400, f"The request body is not valid JSON ({reason}); send a JSON object "
                                   "with Content-Type: application/json.", "body")
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if len(first.get("loc", ())) == 1 and media != "application/json" and not media.endswith("+json"):
        # FastAPI reads JSON only from a JSON content type (none is none); `curl -d` alone sends a form's
        sent = f"as {media!r}" if media else "without a Content-Type"
        return error_response(415, f"The request body was sent {sent}; send it as JSON with Content-Type: "
                                   "application/json (curl: -H 'content-type: application/json').", "body")
    errors = _unions(errors) or [first]
    first = errors[0]
    messages = list(dict.fromkeys(_message(e) for e in errors))  # a pair missing both texts is said once
    field = _location(first["loc"][:3] if _pair_shape(first) else first["loc"])
    return error_response(422, "; ".join(messages) + _other_route(request, errors), field)


#: pydantic's tag for each member of a union in an error's loc (text_1: str | list[str]) and what JSON calls it
_MEMBERS = {"str": "a string", "list[str]": "a list of strings", "dict[str,str]": "an object of strings"}
_KINDS = {str: "a string", list: "a list", dict: "an object", type(None): "null", bool: "true or false"}


def _unions(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A value refused by every member of a union gets one error per member, each under the member's tag
    (`text_1.list[str][1]`). Where a member took the value's outer type, its errors stand, without the tag; where
    none did, one error names what the field takes."""
    def tag(e):
        return next((i for i, part in enumerate(e["loc"]) if part in _MEMBERS), None)

    out, groups = [], {}
    for e in errors:
        i = tag(e)
        if i is None:
            out.append(e)
        else:
            groups.setdefault(tuple(e["loc"][:i]), []).append((i, e))
    for prefix, members in groups.items():
        inner = [dict(e, loc=prefix + tuple(e["loc"][i + 1:])) for i, e in members if len(e["loc"]) > i + 1]
        if inner:
            out.extend(inner)
        else:
            given = members[0][1].get("input")
            took = " or ".join(_MEMBERS[e["loc"][i]] for i, e in members)
            out.append({"loc": prefix, "type": "union", "input": given,
                        "msg": f"should be {took} (got {_KINDS.get(type(given), 'a number')})"})
    return out


_PAIR = 'each pair is a list of two texts, ["text a", "text b"]'


def _pair_shape(e: dict[str, Any]) -> bool:
    """An error about the shape of `pairs` or of one pair (not about a text in it): JSON has no tuples, so
    pydantic's own words ("a valid tuple", "Field required" at pairs[0][1]) do not tell a client what to send."""
    loc = tuple(part for part in e.get("loc", ()) if part != "body")
    return bool(loc) and loc[0] == "pairs" and (
        (len(loc) == 1 and e.get("type") == "list_type") or (len(loc) == 2 and e.get("type") in (
            "tuple_type", "too_long")) or (len(loc) == 3 and e.get("type") == "missing"))


def _message(e: dict[str, Any]) -> str:
    if not _pair_shape(e):
        return f"{_location(e['loc'])}: {e['msg']}"
    loc, given = [part for part in e["loc"] if part != "body"], e.get("input")
    if e["type"] == "too_long":
        got = f"it has {(e.get('ctx') or {}).get('actual_length', 'more than 2')}"
    elif isinstance(given, list):
        got = f"it has {len(given)}"
    else:  # what JSON calls the value sent
        got = "got " + ("one string" if isinstance(given, str) else _KINDS.get(type(given), "a number"))
    if len(loc) == 1:
        return f'pairs: a list of pairs, [["text a", "text b"], ...] ({got}).'
    return f"{_location(loc[:2])}: {_PAIR} ({got})."


def _other_route(request: Request, errors: list[dict[str, Any]]) -> str:
    """A body meant for another endpoint (a rerank body sent to /v1/score) is named as such: the route whose
    request schema (the app's OpenAPI spec) has every field this one refused as unknown."""
    extra = {e["loc"][-1] for e in errors if e.get("type") == "extra_forbidden" and len(e["loc"]) == 2}
    if not extra or any(e.get("type") not in ("extra_forbidden", "missing") for e in errors):
        return ""
    spec = request.app.openapi()
    schemas = spec.get("components", {}).get("schemas", {})
    for path, operations in spec.get("paths", {}).items():
        body = operations.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json", {})
        name = body.get("schema", {}).get("$ref", "").rsplit("/", 1)[-1]
        if path != request.url.path and name and extra <= set(schemas.get(name, {}).get("properties", {})):
            where = request.scope.get("root_path", "") + path
            return f" ({', '.join(sorted(extra))}: fields of POST {where}; send this body there, see /docs)"
    return ""


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = str(exc.detail)
    if exc.status_code == 400 and "parsing the body" in message:
        message = ("The request body could not be parsed: send UTF-8 encoded JSON (Content-Type: "
                   "application/json), nested no deeper than the API's schemas.")
    elif exc.status_code == 404:
        message = f"No route {request.url.path}; see /docs for the API."
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}; see /docs for the API."
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "Internal error while handling the request; the replica's log has the traceback.")


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unexpected)


#: the error statuses every endpoint documents in the OpenAPI spec
def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    statuses += (415,) if 400 in statuses else ()  # a route that takes a body refuses one that is not sent as JSON
    descriptions = {400: "the body is not valid JSON / not UTF-8", 404: "unknown route or job",
                    415: "the body is not sent as JSON (Content-Type: application/json)",
                    413: "over a size limit: the body (max_body_bytes, max_warm_body_bytes) or a warm's texts "
                         "(max_warm_sync)",
                    422: "a field is invalid (the field is named)",
                    503: "overloaded: retry after Retry-After seconds", 504: "the request exceeded request_timeout_s",
                    500: "unexpected error"}
    return {s: {"model": ErrorBody, "description": descriptions.get(s, "error")} for s in statuses}
