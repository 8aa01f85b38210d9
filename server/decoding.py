"""Requests that fail to parse reach their handler as `Malformed`, not as gRPC's bare INTERNAL.

gRPC answers a request it cannot deserialize with INTERNAL ("Exception
deserializing request!"), which blames the server for the edge's bytes. This
interceptor swaps in a deserializer that hands such a request to the handler
as `Malformed`, so the handler authenticates the caller first and then
refuses the request with INVALID_ARGUMENT (server/service.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

import grpc


@dataclasses.dataclass(frozen=True)
class Malformed:
    """A request whose bytes are not a valid message of the method's request type."""

    message_type: str
    error: str

    def __str__(self) -> str:
        return (
            f"the request is not a valid {self.message_type} ({self.error}); send a message built from specedge.proto"
        )


class LenientDecoding(grpc.aio.ServerInterceptor):
    def __init__(self, service_prefix: str):
        self.service_prefix = service_prefix  # e.g. "/specedge.v1.SpecEdge/": other services keep gRPC's behaviour

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.service_prefix):
            return handler
        parse = handler.request_deserializer
        descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)  # FromString of a message class
        message_type = descriptor.full_name if descriptor is not None else "request message"

        def lenient(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # the protobuf runtime's DecodeError, or anything it raises on junk
                return Malformed(message_type, str(exc) or type(exc).__name__)

        return handler._replace(request_deserializer=lenient)
