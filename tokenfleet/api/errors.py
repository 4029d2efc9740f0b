"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # e.g. retry-after and x-ratelimit-* on a 429

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, "invalid_request_error", param, code)


def conflict(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """409: the request is well formed but the resource's state does not allow it (e.g. stopping a finished reply)."""
    return APIError(409, message, "invalid_request_error", param, code)


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error")


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", code="service_unavailable")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "invalid_request_error", code="invalid_api_key")


def rate_limited(message: str, headers: dict[str, str], code: str = "rate_limit_exceeded") -> APIError:
    """OpenAI's 429: the SDK retries it by itself, waiting as long as retry-after(-ms) says."""
    return APIError(429, message, "requests", code=code, headers=headers)
