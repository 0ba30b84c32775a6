"""Errors a client can be told about, in one place for both APIs.

Each carries its HTTP status, OpenAI's error `type`, and the gRPC status code that means the
same thing, so the HTTP and gRPC front ends report a refusal identically.
"""

from __future__ import annotations

from typing import Any


class RouterError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        grpc_code: str,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.grpc_code, self.param, self.retry_after_s = grpc_code, param, retry_after_s

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, int(self.retry_after_s + 0.999)))}


def bad_request(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, "invalid_request_error", "INVALID_ARGUMENT", param)


def too_large(message: str) -> RouterError:
    return RouterError(413, message, "invalid_request_error", "INVALID_ARGUMENT")


def unauthorized(message: str) -> RouterError:
    return RouterError(401, message, "authentication_error", "UNAUTHENTICATED")


def not_found(message: str, param: str | None = None) -> RouterError:
    return RouterError(404, message, "not_found_error", "NOT_FOUND", param)


def rate_limited(retry_after_s: float, limit: str = "rate limit") -> RouterError:
    """429 for one of the key's buckets (`limit`: "rate limit", "token rate limit")."""
    return RouterError(
        429,
        f"{limit} reached for this API key; retry in {retry_after_s:.1f} s",
        "rate_limit_error",
        "RESOURCE_EXHAUSTED",
        retry_after_s=retry_after_s,
    )


def too_many_concurrent(limit: int) -> RouterError:
    return RouterError(
        429,
        f"this API key has {limit} concurrent requests in flight, its limit; retry when "
        "one has finished",
        "rate_limit_error",
        "RESOURCE_EXHAUSTED",
        retry_after_s=1.0,
    )


def overloaded(message: str, retry_after_s: float = 1.0) -> RouterError:
    return RouterError(
        503, message, "service_unavailable", "UNAVAILABLE", retry_after_s=retry_after_s
    )


class GroupFailed(RouterError):
    """A verifier group failed under a request (its actor died, or a rank of it restarted):
    503, and the router may move the request to a healthy group (router/service.py)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, "service_unavailable", "UNAVAILABLE", retry_after_s=1.0)


def shared_state_down(exc: Exception) -> RouterError:
    """Redis did not answer: 503, the request can be retried."""
    return overloaded(f"shared state (Redis) is unavailable: {exc}")


def server_error(message: str) -> RouterError:
    return RouterError(500, message, "server_error", "INTERNAL")
