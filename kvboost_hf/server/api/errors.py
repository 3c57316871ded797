"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_overloaded",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
        details: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.details = details or {}
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict:
        body = error_body(self.message, self.type, self.param, self.code)
        body["error"].update(self.details)  # e.g. the memory planner's figures on a 413
        return body

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body OpenAI returns for an error."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None, "invalid_request"
    first = errors[0]
    # pydantic names the union member that failed ("literal['none','auto']", "str"): not a field
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _union_member(str(part))]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg', '')}", None, "invalid_json"
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ValueError):  # a validator's own message, without pydantic's "Value error, " prefix
        msg = str(cause)
        param = getattr(cause, "param", None) or param  # schemas.ParamError names the field of a cross-field check
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return message, param, "invalid_value"


def _union_member(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "function-after", "function-before")


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation errors with 400, HTTP errors and crashes in OpenAI's error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param, code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(
            error_body(str(exc.detail), _TYPES.get(exc.status_code, "invalid_request_error"), None, code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)
