"""Requests, events and errors exchanged between the worker's gRPC servicer and its engine thread.

The servicer (asyncio) never touches MLX: it builds a `GenerationRequest`, hands it to
`Engine.submit` with a callback, and receives `TokenEvent`s then exactly one `DoneEvent` (or one
`ErrorEvent`) through that callback, called on the engine thread. The servicer forwards them to its
event loop with `loop.call_soon_threadsafe`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol


class EngineError(Exception):
    """Base class of the errors the engine reports; each maps to one gRPC status code."""


class InvalidRequest(EngineError):
    """The request cannot be served as given (INVALID_ARGUMENT); the message says what to fix."""


class Overloaded(EngineError):
    """The worker is at its configured capacity (RESOURCE_EXHAUSTED); retry elsewhere or later."""


class Draining(EngineError):
    """The worker is shutting down or not ready (UNAVAILABLE)."""


class UnknownSession(EngineError):
    """No running session of that request id has a state to export (NOT_FOUND): unknown,
    finished, or not decoding yet."""


class NotExportable(EngineError):
    """The session's decoding method keeps no exportable state (FAILED_PRECONDITION)."""


class StateMismatch(EngineError):
    """An imported state was written for another format, model, dtype or layout
    (FAILED_PRECONDITION); the message says what differs."""


class CorruptState(EngineError):
    """An imported state's bytes fail their checksums or are incomplete (DATA_LOSS)."""


@dataclass(frozen=True)
class SamplingParams:
    """Token selection.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_p: nucleus mass in (0, 1]; 1.0 disables it.
        seed: seed of the request's own random stream; None draws one at random.
        presence_penalty: subtracted from the logit of every token the output holds (OpenAI's).
        frequency_penalty: subtracted from a token's logit once per time the output holds it.
        repetition_penalty: divides a positive logit (multiplies a negative one) of every token
            of the prompt and output (CTRL's, as Hugging Face and mlx-lm apply it); 1.0: none.
        logit_bias: (token id, bias) pairs; each bias is added to its token's logit everywhere.
        (The penalties and bias: worker/engine/penalties.py.)
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must be (structured output, worker/engine/grammar.py).

    Attributes:
        type: "json_object" (any JSON object), "json_schema" (JSON valid against `json_schema`)
            or "tool_calls" (tool calls only, in the model's tool-call format: tool_choice
            "required" or a named function; flashfleet/tool_calls.py).
        json_schema: the JSON Schema as JSON text ("json_schema" only).
        tools: the OpenAI tools list as JSON text ("tool_calls" only).
        function: the one function to call, or "" for any of `tools` ("tool_calls" only).
        parallel_calls: whether several calls may follow one another ("tool_calls" only).
    """

    type: str
    json_schema: str = ""
    tools: str = ""
    function: str = ""
    parallel_calls: bool = False


MAX_TOP_LOGPROBS = 20  # most alternatives a token's log-probabilities list (OpenAI's bound)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target's own distribution at its position
    (log-softmax of the target's logits: no temperature, top-p or grammar applied), and the most
    likely tokens there; a generated token's, or a prompt token's (`TokenEvent.prompt_logprobs`).

    Attributes:
        token_id: the token.
        logprob: its natural-log probability (float32 arithmetic); None for a prompt's first
            token (nothing precedes it).
        top: (token id, logprob) of the `top_logprobs` most likely tokens, most likely first.
        text: the token's text on its own; top_text: the top tokens' (filled when emitted).
    """

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()
    text: str = ""
    top_text: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """One generation, already tokenized.

    Attributes:
        request_id: unique per worker while running.
        prompt_tokens: prompt token ids (chat template already applied), non-empty.
        max_tokens: upper bound on generated tokens, > 0 (0 with prompt_logprobs: the prompt is
            scored, nothing is generated).
        sampling: temperature / top-p / seed.
        stop: stop strings; output ends before the first occurrence of any of them.
        mode: "auto", "plain", "draft", "dflash" or "uag".
        resume_tokens: a migrated session's output so far (another worker streamed these ids;
            fewer than max_tokens, which counts them): decoding continues after
            prompt_tokens + resume_tokens.
        resume_text: the text the client received with resume_tokens (a prefix of their text).
        import_id: a state staged by `Engine.transfer.stage_import` to use instead of prefilling the
            tokens it covers ("" for none; `worker.engine.kv_transfer`).
        response_format: constrains the output to JSON (worker/engine/grammar.py); None: free text.
        top_logprobs: -1: no log-probabilities; 0..MAX_TOP_LOGPROBS: each token's `TokenLogprob`
            with that many alternatives (batched modes only).
        prompt_logprobs: -1: none; 0..MAX_TOP_LOGPROBS: one `TokenLogprob` per prompt token, with
            that many alternatives, in an event before the first token (batched modes only; the
            prompt is prefilled in full, without the prompt cache).
    """

    request_id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    mode: str = "auto"
    resume_tokens: tuple[int, ...] = ()
    resume_text: str = ""
    import_id: str = ""
    response_format: ResponseFormat | None = None
    top_logprobs: int = -1
    prompt_logprobs: int = -1


@dataclass
class GenerationStats:
    """Final statistics of one request (times in seconds).

    Fields as in `flashfleet.types.GenerationStats` (the GenerationStats proto): ttft_s from
    `Engine.submit` accepting the request; tokens_per_s over the decode phase (tokens after the
    first step); cached_tokens: prompt tokens whose KV came from the worker's prompt cache (not
    prefilled); transferred_tokens: positions whose KV came from another worker by KV transfer;
    preemptions: times the session was paused for memory and resumed by recomputing;
    cycles / drafted_tokens / accepted_tokens count speculative cycles only
    (accepted excludes the bonus token); accepted_per_position[i] = cycles whose draft token at
    block position i+1 was accepted.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    tokens_per_s: float = 0.0
    total_s: float = 0.0
    mode: str = "plain"
    cycles: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    translate_s: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    preemptions: int = 0
    transferred_tokens: int = 0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per speculative cycle, bonus token included (tau); 0 if none."""
        return (self.accepted_tokens + self.cycles) / self.cycles if self.cycles else 0.0


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of a request. `text` holds only complete UTF-8 characters (may be "").
    `logprobs`: one `TokenLogprob` per token id when the request asked for them, else empty
    (with prompt_logprobs, one more, last, for the EOS token that ended the generation).
    `prompt_logprobs`: one `TokenLogprob` per prompt token, in one event with no tokens before
    the first token, when the request asked for them (`GenerationRequest.prompt_logprobs`)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class DoneEvent:
    """Last event of a request. finish_reason is "stop", "length" or "cancelled"."""

    request_id: str
    finish_reason: str
    stats: GenerationStats


@dataclass(frozen=True)
class ErrorEvent:
    """A request failed after it was admitted; the engine keeps serving the others."""

    request_id: str
    error: Exception


EngineEvent = TokenEvent | DoneEvent | ErrorEvent
EmitFn = Callable[[EngineEvent], None]


@dataclass(frozen=True)
class ModelDescription:
    """What a worker serves: names and limits that the servicer validates requests against."""

    name: str
    max_context_tokens: int
    draft: str = ""
    draft_mode: str = ""  # "", "draft", "dflash" or "uag"
    # Memory footprint, for the worker's bandwidth and KV metrics (0 = unknown); see
    # worker.metrics.model_footprint.
    weights_bytes: int = 0
    kv_bytes_per_token: int = 0
    draft_weights_bytes: int = 0
    draft_kv_bytes_per_token: int = 0
    num_draft_tokens: int = 0  # draft tokens per speculative cycle (k); 0 without a draft
    tool_call_format: str = ""  # the chat template's (flashfleet/tool_calls.py); "": tools are refused


@dataclass(frozen=True)
class EngineLoad:
    """Snapshot of the engine's load, reported in heartbeats."""

    active_sessions: int
    capacity: int
    kv_cache_bytes: int
    kv_budget_bytes: int = 0  # 0: unknown (the engine is not running)
    prompt_cache_bytes: int = 0  # finished turns kept for reuse (evicted first when sessions need room)
    # For the coordinator's migration policy (worker/engine/profile.py): each session's snapshot
    # (SessionSnapshot), the decode profile (DecodeCostEntry) and seconds per prefilled token.
    sessions: tuple = ()
    decode_profile: tuple = ()
    prefill_seconds_per_token: float = 0.0
    kv_layers: int = 0  # the target's attention layers (flashfleet/kv_need.py); 0 = not loaded yet

    @property
    def kv_free_bytes(self) -> int:
        """KV bytes new sessions can have: the budget less running sessions' caches (the prompt
        cache gives way)."""
        return max(0, self.kv_budget_bytes - self.kv_cache_bytes)


class EngineProtocol(Protocol):
    """What the servicer needs from an engine; tests substitute a fake."""

    @property
    def model(self) -> ModelDescription:
        """The served model: name, context limit, draft."""
        ...

    def encode_prompt(self, prompt: str | None, messages: list[dict] | None,
                      tools: list[dict] | None = None) -> list[int]:
        """Tokenizes raw text, or renders chat messages (and the tools the model may call) with
        the model's template.

        Raises:
            InvalidRequest: malformed messages or tools, or a template that rejects them.
        """

    def submit(self, request: GenerationRequest, emit: EmitFn) -> None:
        """Queues a request. Never blocks on MLX work.

        Raises:
            InvalidRequest: prompt + max_tokens beyond the context, empty prompt, bad mode.
            Overloaded: capacity reached.
            Draining: shutting down.
        """

    def abort(self, request_id: str) -> bool:
        """Cancels a request; it ends with DoneEvent("cancelled"). False when it is unknown."""

    def load(self) -> EngineLoad:
        """Current load (sessions, capacity, KV cache bytes); callable from any thread."""
        ...

    def close(self) -> None:
        """Stops the engine thread after the running requests are cancelled, frees MLX memory."""
