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


class Unauthenticated(FlashfleetError):
    """The coordinator requires an API key and the call carried none or a wrong one
    (Client(..., api_key=...) or env FLASHFLEET_API_KEY)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(FlashfleetError):
    """The call's API key is valid but its role may not make it: DrainWorker and MoveSession
    need a key with the `admin` role."""

    code = grpc.StatusCode.PERMISSION_DENIED


_BY_CODE: dict[grpc.StatusCode, type[FlashfleetError]] = {
    cls.code: cls
    for cls in (InvalidArgument, ModelNotFound, Overloaded, Unavailable, DeadlineExceeded,
                Cancelled, FailedPrecondition, Unauthenticated, PermissionDenied)
}


MAX_DETAILS_CHARS = 2000  # gRPC refuses a status message over 16 KB: it would reach the client as a
# transport error (RESOURCE_EXHAUSTED), hiding the real one


def short_details(text: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """An error message cut to `limit` characters (a message quoting a huge input stays readable
    and within gRPC's limit on status details)."""
    return text if len(text) <= limit else text[: limit - 40] + f"... ({len(text) - limit + 40:,} more characters)"


def from_rpc_error(error: grpc.RpcError, secure: bool | None = None) -> FlashfleetError:
    """Converts a failed gRPC call into the matching SDK exception (INTERNAL and unknown codes
    become FlashfleetError).

    Args:
        secure: whether the channel used TLS (None: unknown). A connection that fails the way a
            TLS mismatch does gets a hint saying which side to fix: gRPC itself reports only a
            closed socket or a failed handshake.
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    if code == grpc.StatusCode.UNAVAILABLE and secure is not None:
        details += _tls_hint(details, secure)
    return _BY_CODE.get(code, FlashfleetError)(details, code)


def _tls_hint(details: str, secure: bool) -> str:
    text = details.lower()
    if "hostname verification" in text:
        return (" (TLS: the server's certificate does not name the host dialled: dial a name its "
                "certificate carries (subjectAltName, e.g. localhost), or reissue it for this one)")
    if "handshake failed" in text:
        return (" (TLS handshake failed: the server may not serve TLS, or its certificate is not signed "
                "by the CA of this client's [tls] ca_file, or does not name the address dialled)")
    # Only gRPC's own report of a connection that closed before any call ran: a server's message
    # that quotes one (the coordinator relaying a worker lost mid-stream) is not a TLS problem.
    if "socket closed" in text and (text.startswith("socket closed") or
                                    text.startswith("failed to connect to all addresses")):
        return (" (the server closed the connection: it may require mutual TLS and a client "
                "certificate signed by the cluster CA; check cert_file and key_file of [tls])" if secure
                else " (the server closed the connection: if the cluster serves TLS, connect with its "
                "[tls] files: --config cluster.toml on the CLI, Client(address, credentials=...) in Python)")
    return ""
