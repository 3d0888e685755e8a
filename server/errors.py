"""OpenAI-style error bodies ({"error": {message, type, param, code}}) and the app's error handlers."""

from __future__ import annotations

import logging
from http import HTTPStatus

from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException

log = logging.getLogger("hybrid_jax.server")

# vLLM names its error types after the HTTP status (BadRequestError, NotFoundError, ...).
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    499: "ClientClosedRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error to send to the client; ``code`` defaults to the HTTP status (as vLLM does)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = status if code is None else code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status) or _phrase(self.status).replace(" ", "") + "Error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def unavailable(message: str, retry_after_s: int) -> APIError:
    """A 503 that says when to try again."""
    return APIError(503, message, headers={"Retry-After": str(retry_after_s)})


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_value_error(error: ValueError) -> APIError:
    """A 400 from a ``"field: why"`` ValueError (SamplingParams, Engine.submit), naming the field as param."""
    text = str(error)
    field, sep, _ = text.partition(": ")
    return bad_request(text, field if sep and field.isidentifier() else None)


def register_error_handlers(app: Flask) -> None:
    """Every error leaves as an OpenAI-style JSON body; unexpected exceptions are logged and become a 500."""

    @app.errorhandler(APIError)
    def api_error(e: APIError):
        return jsonify(e.body()), e.status, e.headers

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        status = e.code or 500
        error = APIError(status, e.description or _phrase(status))
        response = jsonify(error.body())
        if allowed := getattr(e, "valid_methods", None):
            response.headers["Allow"] = ", ".join(allowed)
        return response, status

    @app.errorhandler(Exception)
    def unexpected(e: Exception):
        log.exception("unhandled error")
        return jsonify(APIError(500, f"internal error: {type(e).__name__}").body()), 500
