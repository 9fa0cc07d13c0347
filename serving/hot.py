"""The scoring and re-ranking routes past FastAPI's routing and body machinery (an ASGI middleware).

On a warm 32-pair request the ingress replica spends ~1.6 ms of CPU, of which FastAPI's routing, dependency
solving and body parsing (the stdlib's JSON, then pydantic on the Python objects) are ~0.12 ms: measured
against the same stub endpoint with and without this middleware through Serve's HAProxy ingress. The ingress's
event loop is the service's bottleneck, so that share is throughput and tail latency.

`HotRoutes` takes a POST to a registered path with a JSON body, validates it with the route's own request model
from the raw bytes (`model_validate_json`: pydantic's Rust parser, no Python objects in between) and calls the
route's own handler. Anything else goes to FastAPI unchanged, the body replayed: another path or method, another
content type, and every body the model refuses, so FastAPI's parser and validation write every error response
exactly as before. The handler's `ApiError` gets the app's error body (serving/errors.py); any other exception
goes on to Starlette's error middleware, as from a FastAPI route. tests/test_hot_routes.py checks that a body
answers the same through both paths.

It also holds every POST body to its size limit, a hot route's (max_body_bytes) and the warm routes' that FastAPI
answers (max_warm_body_bytes): 413 from a Content-Length past it before anything is read, or, for a body of no
declared length (chunked), as soon as what has arrived passes it.
"""
from __future__ import annotations

import typing
from typing import Any, Awaitable, Callable

from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import RayServeException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.errors import ApiError, api_error_response

Handler = Callable[[Any], Awaitable[Any]]
#: what a 413 tells the client to do, by the option whose limit the body passed
ADVICE = {"max_body_bytes": "Send fewer or shorter texts per request.",
          "max_warm_body_bytes": "Send the texts in several smaller requests (or jobs)."}


class HotRouteTable:
    """path -> (the route's request model, its handler), how many requests each path answered past FastAPI, and the
    most bytes a POST body may have on each limited path. `handlers`: path -> handler, which takes the request model
    as its `body` argument and returns a Response; the model is read from the handler's annotation, as FastAPI reads
    it. `max_body` limits the handlers' paths (max_body_bytes); `limits`, path -> (bytes, the option that sets them),
    limits routes FastAPI answers (the warm routes)."""

    def __init__(self, handlers: dict[str, Handler], max_body: int | None = None,
                 limits: dict[str, tuple[int, str]] | None = None) -> None:
        self.routes = {path: (typing.get_type_hints(h)["body"], h) for path, h in handlers.items()}
        self.served = dict.fromkeys(handlers, 0)
        #: path -> (the most bytes its body may have: 413 past it, before the rest is read; the option's name)
        self.limits = {**({path: (max_body, "max_body_bytes") for path in handlers} if max_body else {}),
                       **(limits or {})}

    def too_large(self, path: str, size: int, declared: bool) -> ApiError | None:
        """The 413 of a body of `size` bytes on `path` (declared: its Content-Length; else what was read so far), None
        within the limit or where the path has none."""
        if path not in self.limits or size <= self.limits[path][0]:
            return None
        limit, option = self.limits[path]
        return ApiError(413, f"The request body has {size} bytes{'' if declared else ' or more'}; the limit is "
                             f"{limit} ({option}). {ADVICE.get(option, ADVICE['max_body_bytes'])}", "body")


def replica_table() -> HotRouteTable | None:
    """The `hot_routes` of this Serve replica's deployment instance, None outside a replica or where it has none.
    Serve runs a frozen copy of the FastAPI app, so the middleware finds the handlers through the replica context."""
    try:
        instance = serve.get_replica_context().servable_object
    except RayServeException:
        return None
    return getattr(instance, "hot_routes", None)


def _json_and_length(scope: Scope) -> tuple[bool, int]:
    """(whether the body is declared JSON, its declared Content-Length: 0 when none, chunked, or unreadable), read in
    one pass over the headers."""
    is_json, length = False, 0
    for name, value in scope["headers"]:
        if name == b"content-type":
            is_json = value.split(b";", 1)[0].strip().lower() == b"application/json"
        elif name == b"content-length":
            length = int(value) if value.isdigit() else 0
    return is_json, length


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands `body` over once more, then the connection's own messages (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def again() -> Message:
        return pending.pop() if pending else await receive()
    return again


class HotRoutes:
    """ASGI middleware; see the module docstring. `find` gives the routes (default: this replica's)."""

    def __init__(self, app: ASGIApp, find: Callable[[], HotRouteTable | None] = replica_table) -> None:
        self.app, self.find, self.table = app, find, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route = None
        if scope["type"] == "http" and scope["method"] == "POST":
            path, root = scope["path"], scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root):]
            if self.table is None:
                self.table = self.find()
            route = self.table.routes.get(path) if self.table else None
        if route is None and (self.table is None or path not in self.table.limits):
            return await self.app(scope, receive, send)
        is_json, length = _json_and_length(scope)
        if error := self.table.too_large(path, length, declared=True):
            return await api_error_response(error)(scope, receive, send)  # declared too large: nothing read
        hot = route is not None and is_json
        if not hot and (length or path not in self.table.limits):  # the server reads no more than was declared
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nobody to answer
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if error := self.table.too_large(path, size, declared=False):  # undeclared (chunked): stop past it
                return await api_error_response(error)(scope, receive, send)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        if not hot:
            return await self.app(scope, _replay(body, receive), send)
        model, handler = route
        try:
            request = model.model_validate_json(body)
        except ValidationError:  # FastAPI parses and validates again and writes the error response
            return await self.app(scope, _replay(body, receive), send)
        self.table.served[path] += 1
        try:
            response = await handler(request)
        except ApiError as exc:
            response = api_error_response(exc)
        await response(scope, receive, send)
