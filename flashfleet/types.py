"""Typed results the SDK returns instead of raw protos."""
from __future__ import annotations

from dataclasses import dataclass, field

from flashfleet.v1 import common_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
}
DECODE_MODES = {
    "auto": common_pb2.DECODE_MODE_AUTO,
    "plain": common_pb2.DECODE_MODE_PLAIN,
    "draft": common_pb2.DECODE_MODE_DRAFT,
    "dflash": common_pb2.DECODE_MODE_DFLASH,
    "uag": common_pb2.DECODE_MODE_UAG,
}
DECODE_MODE_NAMES = {v: k for k, v in DECODE_MODES.items()}


@dataclass(frozen=True)
class GenerationStats:
    """Statistics of one finished request, as measured by the worker (times in seconds).

    Attributes:
        prompt_tokens, generated_tokens: token counts of the request.
        ttft_s: time to first token (TTFT), from the worker receiving the request.
        tokens_per_s: generated tokens per second over the decode phase (after the first token).
        total_s: the whole request on the worker.
        mode: the decoding method used: "plain", "draft", "dflash" or "uag".
        cycles, drafted_tokens, accepted_tokens: speculative runs only (0 otherwise): draft +
            verify cycles, draft tokens proposed to the target, and those the target accepted
            (bonus tokens excluded).
        acceptance_length: tau, mean tokens committed per speculative cycle, bonus token included.
        draft_s, verify_s: time spent drafting and in the target's verify forwards.
        accepted_per_position: element i = cycles whose draft token at block position i+1 was
            accepted.
        queue_s: time in the coordinator before the call to the serving worker started (routing
            and earlier failed attempts; not the worker's prefill).
        translate_s: cross-tokenizer (UAG) drafts only: time translating between vocabularies.
        migrations: times the coordinator moved the request to another worker mid-stream; after
            one, the times and speculative counts are the last worker's, the token counts the
            request's.
        cached_tokens: prompt tokens whose KV cache the worker reused from an earlier turn with
            the same prefix (its prompt cache) instead of prefilling them; part of prompt_tokens.
        preemptions: times the worker paused the request to free KV memory for other sessions and
            resumed it by recomputing its cache (each costs about one prefill of its context).
        transferred_tokens: positions whose KV cache the last worker received from the previous
            one (a migration by KV transfer) instead of prefilling them.
    """

    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    tokens_per_s: float
    total_s: float
    mode: str
    cycles: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_length: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accepted_per_position: tuple[int, ...] = ()
    queue_s: float = 0.0
    translate_s: float = 0.0
    migrations: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    transferred_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @classmethod
    def from_proto(cls, s: common_pb2.GenerationStats) -> "GenerationStats":
        """The SDK's copy of a `flashfleet.v1.GenerationStats` proto (field for field)."""
        return cls(
            prompt_tokens=s.prompt_tokens, generated_tokens=s.generated_tokens, ttft_s=s.ttft_s,
            tokens_per_s=s.tokens_per_s, total_s=s.total_s, mode=s.mode, cycles=s.cycles,
            drafted_tokens=s.drafted_tokens, accepted_tokens=s.accepted_tokens,
            acceptance_length=s.acceptance_length, draft_s=s.draft_s, verify_s=s.verify_s,
            accepted_per_position=tuple(s.accepted_per_position), queue_s=s.queue_s,
            translate_s=s.translate_s, migrations=s.migrations, cached_tokens=s.cached_tokens,
            preemptions=s.preemptions, transferred_tokens=s.transferred_tokens,
        )


@dataclass(frozen=True)
class Chunk:
    """Streamed piece of a generation.

    text: new text (complete UTF-8 characters only); token_ids: the tokens generated since the
    previous chunk; logprobs: one `TokenLogprob` proto per token id when the request set
    top_logprobs (token_id, token, logprob, top: the most likely tokens); prompt_logprobs: when
    the request set prompt_logprobs, the first chunk's (no text, no token ids) one `TokenLogprob`
    per prompt token (the first without a logprob: `HasField("logprob")` is False). The last
    chunk of a stream has finish_reason and stats set, and may have no text.
    """

    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    worker_id: str = ""
    logprobs: tuple = ()
    prompt_logprobs: tuple = ()
    served_by: tuple[str, ...] = ()  # last chunk: every worker that served it, in order


@dataclass(frozen=True)
class Completion:
    """A whole generation: text, its token ids, why it ended and its statistics.

    With finish_reason "stop", `text` ends before the stop string, while `token_ids` keep every
    token the model generated, up to and including the one in which the stop string ended (a
    token may hold a stop string's end and more): decode `text`, not `token_ids`, for the answer.
    """

    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprob protos, one per token id (top_logprobs set)
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob protos, one per prompt token (prompt_logprobs set)
    finish_reason: str = ""
    stats: GenerationStats | None = None
    worker_id: str = ""
    served_by: tuple[str, ...] = ()  # every worker that served it, in order (moves, failovers)
