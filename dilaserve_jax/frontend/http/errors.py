"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with their HTTP status."""
from __future__ import annotations

from starlette.responses import JSONResponse

from dilaserve_jax.frontend.admin import bounded
from dilaserve_jax.frontend.calls import CallError, Failure

RETRY_AFTER_S = 1  # what 429 and 503 answers suggest in Retry-After

# status, type, code per failure of the shared generation path
FAILURES = {
    Failure.INVALID: (400, "invalid_request_error", None),
    Failure.NO_TOKENIZER: (400, "invalid_request_error", "no_tokenizer"),
    Failure.DUPLICATE: (409, "invalid_request_error", "duplicate_request_id"),
    Failure.UNAVAILABLE: (503, "service_unavailable", "unavailable"),
    Failure.EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    Failure.DEADLINE: (504, "timeout_error", "deadline_exceeded"),
    Failure.ABORTED: (503, "service_unavailable", "aborted"),
    Failure.INTERNAL: (500, "server_error", "internal_error"),
}
TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable", 504: "timeout_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.type = type or TYPES.get(status, "invalid_request_error")
        self.headers = dict(headers or {})
        if status in (429, 503):
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def body(self) -> dict:
        return {"error": {"message": bounded(str(self), 1024), "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_call_error(err: CallError, fields: dict[str, str] | None = None, prefix: str | None = None) -> ApiError:
    """The HTTP error of a failure of the shared path. `fields` renames the gRPC request's fields to
    this request's (max_new_tokens -> max_tokens, text -> prompt) in the param and the message;
    `prefix` names which of several prompts it was ("prompt[2]")."""
    status, kind, code = FAILURES[err.failure]
    fields = fields or {}
    message, param = str(err), err.field
    if param is not None:
        http = fields.get(param, param)
        if message.startswith(param + ":"):
            message = (prefix or http) + message[len(param):]
        param = http
    if "max_new_tokens" in fields:  # named inside other fields' messages too
        message = message.replace("max_new_tokens", fields["max_new_tokens"])
    return ApiError(status, message, param=param, code=code, type=kind)
