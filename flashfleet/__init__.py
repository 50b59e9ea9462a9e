"""flashfleet: serve LLMs from a fleet of Apple Silicon Macs over gRPC.

This package is the light client side (SDK + CLI); it never imports MLX.

    from flashfleet import Client
    with Client("localhost:50051") as client:
        for chunk in client.generate("SmolLM2-135M-Instruct", prompt="Hello"):
            print(chunk.text, end="")

The SDK's names load on first use (PEP 562), so ``flashfleet.models`` and ``flashfleet draft``
(training on a GPU machine) do not import grpcio and its generated stubs.
"""
from __future__ import annotations

import importlib

# name -> module that defines it
_EXPORTS = {
    "AsyncClient": "flashfleet.client",
    "Client": "flashfleet.client",
    "Chunk": "flashfleet.types",
    "Completion": "flashfleet.types",
    "GenerationStats": "flashfleet.types",
    "FlashfleetError": "flashfleet.errors",
    "InvalidArgument": "flashfleet.errors",
    "ModelNotFound": "flashfleet.errors",
    "Overloaded": "flashfleet.errors",
    "Unavailable": "flashfleet.errors",
    "DeadlineExceeded": "flashfleet.errors",
    "Cancelled": "flashfleet.errors",
    "Unauthenticated": "flashfleet.errors",
    "PermissionDenied": "flashfleet.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """Load an SDK name on first access; raises AttributeError for any other name."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashfleet' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
