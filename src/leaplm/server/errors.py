"""Errors as HTTP responses: every exception a route or the framework raises becomes OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}`, a validation failure a 400 naming the field."""
from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import APIError, error_body

log = logging.getLogger(__name__)


def _loc(loc) -> str | None:
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic/FastAPI validation error as a 400 naming the field."""
    e = errors[0]
    kind = e.get("type")
    param = _loc(e.get("loc", ()))
    if kind == "leaplm_field":
        param = e["ctx"]["field"]
        return APIError(400, e["msg"], param, "invalid_value")
    if kind == "json_invalid":
        pos = e.get("loc", ("body", 0))[-1]
        return APIError(400, f"malformed JSON body ({(e.get('ctx') or {}).get('error', 'decode error')} at byte "
                             f"{pos})", None, "invalid_json")
    if param is None:
        if kind == "missing":
            return APIError(400, "the request body is missing; send a JSON object", None, "invalid_json")
        return APIError(400, "the request body must be a JSON object", None, "invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"{param}: unknown field; leaplm does not accept it (nothing is ignored silently)",
                        param, "unknown_field")
    if kind == "missing":
        return APIError(400, f"{param}: field required", param, "missing_field")
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return APIError(400, f"{param}: {msg}", param, "invalid_value")


def json_error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Map APIError, validation errors, HTTP errors and anything unexpected (500, logged) onto JSON errors."""
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return json_error(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        return json_error(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_body(str(exc.detail), kind, None, code), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def crash(request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body("internal server error", "server_error"), 500)
