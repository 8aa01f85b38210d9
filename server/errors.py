"""Every failure a client can cause, each with exactly one gRPC status.

Handlers raise these; one decorator in service.py turns them into statuses.
The message is written for the person at the edge: it says what to change.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, retry_after_s: float | None = None, limit: str | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s  # sent as the `retry-after-ms` trailer
        self.limit = limit  # which limit refused, sent as the `specedge-limit` trailer (wire.LIMIT_ROUND_RATE)


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Internal(ServiceError):
    """The server failed on this request alone (see server/isolation.py); other requests are unaffected."""

    code = grpc.StatusCode.INTERNAL
