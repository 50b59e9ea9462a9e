"""Chunks queued for one stream, sent on as one message: fewer messages per token, none held back
(the worker before it sends, the coordinator before it relays to a client that fell behind)."""
from __future__ import annotations

from typing import Sequence

from flashfleet.v1 import common_pb2

MAX_COALESCED = 256  # queued chunks one message carries at most (its size stays far under gRPC's limit)


def coalesce(responses: Sequence[common_pb2.GenerateResponse], i: int) -> tuple[common_pb2.GenerateResponse, int]:
    """The chunk `responses[i]` merged with the chunks queued right behind it, and the index after
    the last one taken: one message for what a stream has not yet sent (an engine iteration's
    burst, or chunks that piled up while the stream's reader was slower than its source: a
    worker's call or subscription, the coordinator's client). Only
    chunks already queued are merged, nothing waits for more, so no token comes later than it
    would alone. A chunk of prompt log-probabilities stays a message of its own (the stream's
    first, as the proto says); the merged message ends where a queued chunk ends, so a resume
    point (worker/servicer.py `_Session.resume_index`) is one still. The queued responses are left as they are."""
    first = responses[i]
    j = i + 1
    if not first.chunk.prompt_logprobs:
        while (j < len(responses) and j - i < MAX_COALESCED and responses[j].WhichOneof("kind") == "chunk"
               and not responses[j].chunk.prompt_logprobs):
            j += 1
    if j == i + 1:
        return first, j
    merged = common_pb2.GenerateResponse(request_id=first.request_id)
    chunk = merged.chunk
    chunk.text = "".join(r.chunk.text for r in responses[i:j])
    for r in responses[i:j]:
        chunk.token_ids.extend(r.chunk.token_ids)
        chunk.logprobs.extend(r.chunk.logprobs)
    return merged, j
