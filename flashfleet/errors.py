"""SDK exceptions and the one table between them and gRPC status codes.

Servers raise these (or the engine's own errors mapped onto them) and abort the RPC with the
matching code; the SDK turns a failed RPC back into the same exception class, keeping the gRPC
status code and the server's message.
"""
from __future__ import annotations

import grpc


class FlashfleetError(Exception):
    """Base of all SDK errors.

    Attributes:
        code: the gRPC status code of the failed call.
        details: the server's message (what to fix).
    """

    code = grpc.StatusCode.INTERNAL

    def __init__(self, details: str, code: grpc.StatusCode | None = None):
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class InvalidArgument(FlashfleetError):
    """The request is malformed (empty prompt, bad sampling parameters, too long...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(FlashfleetError):
    """No worker in the fleet serves the requested model, or none of those serving it has a draft
    for the requested decode mode (`mode="dflash"` with no DFlash draft loaded, say)."""

    code = grpc.StatusCode.NOT_FOUND


class Overloaded(FlashfleetError):
    """Every worker serving the model is at capacity; retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(FlashfleetError):
    """The server (or every worker it tried) is unreachable, starting or draining."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(FlashfleetError):
    """The call's deadline passed before it finished."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(FlashfleetError):
    """The call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class FailedPrecondition(FlashfleetError):
    """The request conflicts with the server's state."""

    code = grpc.StatusCode.FAILED_PRECONDITION


_BY_CODE: dict[grpc.StatusCode, type[FlashfleetError]] = {
    cls.code: cls
    for cls in (InvalidArgument, ModelNotFound, Overloaded, Unavailable, DeadlineExceeded,
                Cancelled, FailedPrecondition)
}


def from_rpc_error(error: grpc.RpcError) -> FlashfleetError:
    """Converts a failed gRPC call into the matching SDK exception (INTERNAL and unknown codes
    become FlashfleetError)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    return _BY_CODE.get(code, FlashfleetError)(details, code)
