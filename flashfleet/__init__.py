"""flashfleet: serve LLMs from a fleet of Apple Silicon Macs over gRPC.

This package is the light client side (SDK + CLI); it never imports MLX.

    from flashfleet import Client
    with Client("localhost:50051") as client:
        for chunk in client.generate("SmolLM2-135M-Instruct", prompt="Hello"):
            print(chunk.text, end="")
"""
from flashfleet.errors import (
    Cancelled,
    DeadlineExceeded,
    FlashfleetError,
    InvalidArgument,
    ModelNotFound,
    Overloaded,
    Unavailable,
)
from flashfleet.types import Chunk, Completion, GenerationStats
from flashfleet.client import AsyncClient, Client

__all__ = [
    "AsyncClient", "Client", "Chunk", "Completion", "GenerationStats", "FlashfleetError",
    "InvalidArgument", "ModelNotFound", "Overloaded", "Unavailable", "DeadlineExceeded", "Cancelled",
]
