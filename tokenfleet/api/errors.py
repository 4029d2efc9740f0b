"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, "invalid_request_error", param, code)


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error")


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", code="service_unavailable")
