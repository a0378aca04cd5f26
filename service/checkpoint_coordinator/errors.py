"""One base exception with a stable ``code`` and HTTP status; the API renders it as
``application/problem+json``. Error codes are part of the API: never rename one."""

from __future__ import annotations

from typing import Any


class CoordinatorError(Exception):
    code = "internal_error"
    status = 500
    title = "Internal error"

    def __init__(self, detail: str, *, code: str | None = None, status: int | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.extra = extra

    def problem(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": f"https://ckpt-coordinator.dev/errors/{self.code}",
            "title": self.title,
            "status": self.status,
            "code": self.code,
            "detail": self.detail,
        }
        body.update(self.extra)
        return body


# The refusals, one a line: the class, its stable code, (HTTP status,) title.
class BadRequest(CoordinatorError): code, status, title = "invalid_request", 422, "Invalid request"
class InvalidConfig(CoordinatorError): code, status, title = "invalid_config", 422, "Invalid recovery configuration"
class Unauthorized(CoordinatorError): code, status, title = "unauthorized", 401, "Missing or malformed bearer token"
class Forbidden(CoordinatorError): code, status, title = "forbidden", 403, "Token does not grant access to this resource"
class RequestTimeout(CoordinatorError): code, status, title = "request_timeout", 408, "Request timeout"
class TooManyRequests(CoordinatorError): code, status, title = "too_many_requests", 429, "Too many requests"
class NotFound(CoordinatorError): code, status, title = "not_found", 404, "Not found"
class Conflict(CoordinatorError): code, status, title = "conflict", 409, "Conflicting request"
class RunClosed(Conflict): code, title = "run_closed", "Run is closed"
class GateClosed(CoordinatorError): code, status, title = "gate_closed", 409, "Dispatch gate closed by a snapshot"
class RunStopped(CoordinatorError): code, status, title = "run_stopped", 409, "Run stopped by a stopping snapshot"
class FencedWrite(CoordinatorError): code, status, title = "fenced", 409, "Run epoch changed under this request"
class TooLarge(CoordinatorError): code, status, title = "payload_too_large", 413, "Request body too large"
class Unavailable(CoordinatorError): code, status, title = "unavailable", 503, "Service unavailable"
