"""The FastAPI application the ingress serves: its error handlers, the offline /docs, response helpers."""
# no `from __future__ import annotations`: FastAPI reads annotations at runtime

from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from serving import errors
from serving.errors import ApiError, error_responses
from serving.hot import HotRoutes


def json_response(body: dict[str, Any] | list[Any], status: int = 200, headers: dict[str, str] | None = None
                  ) -> Response:
    """The hot endpoints' responses, serialised once with orjson: FastAPI's generic encoder walks every value of
    the body again, which costs more than the scoring itself, and the stdlib's encoder takes ~0.08 ms for a 32-pair
    score response, orjson ~0.01 ms for the same numbers (without the stdlib's spaces; a NaN as null)."""
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json", headers=headers)


def _docs_assets() -> str | None:
    """The folder of Swagger UI's files, from fastapi-offline (Swagger UI 5: FastAPI's spec is OpenAPI 3.1, which
    Swagger UI 4 does not render); None where the package is missing."""
    try:
        import fastapi_offline
    except ImportError:
        return None
    static = Path(fastapi_offline.__file__).parent / "static"
    return str(static) if (static / "swagger-ui-bundle.js").is_file() else None


DOCS_ASSETS = _docs_assets()  # looked up once: the mount and every /docs request read it
api = FastAPI(title="pair-adapter scorer", version="1", docs_url=None, redoc_url=None,
              description="Pair scoring and re-ranking with a pair-level adapter over frozen sentence embeddings. "
                          'Every error answers {"error": {"type", "message", "field"?}}.')
errors.install(api)
api.add_middleware(HotRoutes)  # POST /v1/score and the rerank routes past FastAPI's routing (serving/hot.py)
if DOCS_ASSETS:  # Swagger UI from a package, not a CDN: /docs works without internet
    api.mount("/docs-assets", StaticFiles(directory=DOCS_ASSETS), name="docs-assets")


@api.get("/docs", include_in_schema=False)
async def docs() -> HTMLResponse:
    if not DOCS_ASSETS:
        return HTMLResponse("<p>Install fastapi-offline for the interactive docs; the spec is at "
                            "<a href='/openapi.json'>/openapi.json</a>.</p>")
    return get_swagger_ui_html(openapi_url="/openapi.json", title=api.title + " - docs",
                               swagger_js_url="/docs-assets/swagger-ui-bundle.js",
                               swagger_css_url="/docs-assets/swagger-ui.css",
                               swagger_favicon_url="/docs-assets/favicon.png")


ERRORS = error_responses(400, 404, 413, 422, 500, 503, 504)
WARM_ERRORS = error_responses(400, 413, 422, 500, 503)  # POST /v1/warm/jobs
#: the headers of a re-ranking response whose documents went through the cascade (the app's rerank_budget)
CASCADE_HEADERS = {
    "x-cascade-routed": {"description": "documents the cascade sent to the cross-encoder (only with the app's "
                                        "rerank_budget above 0)", "schema": {"type": "integer"}},
    "x-cascade-familiarity": {"description": "the request's mean novelty-gate weight, which the app's "
                                             "cascade_familiarity_floor reads (only with rerank_budget above 0)",
                              "schema": {"type": "number"}}}


def reranked(model: Any = None) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses of a re-ranking route: its body `model` (else the route's response_model), the cascade's
    headers, the errors."""
    return {200: {**({"model": model} if model else {}), "headers": CASCADE_HEADERS}, **ERRORS}


def found_job(job: dict[str, Any] | None, job_id: str) -> dict[str, Any]:
    if job is None:
        raise ApiError(404, f"No warm job {job_id!r} (the 100 most recent finished jobs are kept).", "job_id")
    return job
