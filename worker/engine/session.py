"""One admitted request on the engine thread: its decoding generator, text assembly and statistics."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from worker.detokenize import TextAssembler
from worker.engine.types import DoneEvent, EmitFn, GenerationRequest, GenerationStats, TokenEvent, TokenLogprob
from worker.decoding.base import Step


@dataclass
class Session:
    """State of one running request. Touched only by the engine thread.

    Attributes:
        request: the request.
        emit: its event callback.
        steps: its decoding generator.
        caches: every cache the generator writes (for `EngineLoad.kv_cache_bytes`).
        text: detokenizer + stop strings.
        eos_ids: ids that end the generation; an EOS token is counted but never emitted.
        received_s: clock time when `Engine.submit` accepted the request.
        stats: statistics so far (final in the `DoneEvent`).
        first_s / last_s: clock times of the first and latest step, seconds.
        first_step_tokens: tokens of the first step (excluded from tokens_per_s).
        done_reason: "" while running, then "stop" or "length".
    """

    request: GenerationRequest
    emit: EmitFn
    steps: Iterator[Step]
    caches: list[Any]
    text: TextAssembler
    eos_ids: frozenset[int]
    received_s: float
    stats: GenerationStats
    first_s: float | None = None
    first_step_tokens: int = 0
    last_s: float = 0.0
    done_reason: str = field(default="", init=False)

    def on_step(self, step: Step, now_s: float) -> None:
        """Counts a step, emits its TokenEvent, and sets `done_reason` when the request is finished.

        The generation is finished by an EOS token or a stop string ("stop") or by max_tokens
        ("length"). Token ids after the EOS are never produced; ids after a stop string within
        the same step are reported, their text is not.
        """
        tokens = step.tokens
        if not tokens:  # a prefill chunk: no token yet
            return
        st = self.stats
        if self.first_s is None:
            self.first_s, self.first_step_tokens = now_s, len(tokens)
        self.last_s = now_s
        st.generated_tokens += len(tokens)
        if step.drafted:
            st.cycles += 1
            st.drafted_tokens += step.drafted
            st.accepted_tokens += step.accepted
            st.draft_s += step.draft_s
            st.verify_s += step.verify_s
            st.translate_s += step.translate_s
            per_pos = st.accepted_per_position
            if step.drafted > len(per_pos):
                per_pos.extend([0] * (step.drafted - len(per_pos)))
            for i in range(step.accepted):
                per_pos[i] += 1
        eos = tokens[-1] in self.eos_ids
        visible = tokens[:-1] if eos else tokens
        text = self.text.add(visible)
        if self.text.stopped or eos:
            self.done_reason = "stop"
        elif st.generated_tokens >= self.request.max_tokens:
            self.done_reason = "length"
        if self.done_reason and not self.text.stopped:
            text += self.text.finish()
        # Scoring a sequence (prompt_logprobs) lists every token of it, an ending EOS included.
        listed = step.logprobs[: len(tokens) if self.request.prompt_logprobs >= 0 else len(visible)]
        if visible or text or len(listed) > len(visible):
            self.emit(TokenEvent(self.request.request_id, tuple(visible), text,
                                 tuple(self._named(lp) for lp in listed)))

    def emit_prompt_logprobs(self, first: int, scored: list[TokenLogprob]) -> None:
        """Emits the prompt's log-probabilities: its first token `first` (no logprob: nothing
        precedes it), then `scored`, one per later prompt token."""
        lps = (TokenLogprob(first, None), *scored)
        self.emit(TokenEvent(self.request.request_id, (), "", prompt_logprobs=tuple(self._named(lp) for lp in lps)))

    def _named(self, lp: TokenLogprob) -> TokenLogprob:
        """`lp` with its tokens' texts."""
        piece = self.text.piece
        return replace(lp, text=piece(lp.token_id), top_text=tuple(piece(t) for t, _ in lp.top))

    def flush(self) -> None:
        """Emits the text still held back; for a generator that ended without a final step."""
        text = self.text.finish()
        if text:
            self.emit(TokenEvent(self.request.request_id, (), text))

    def done_event(self, reason: str, now_s: float) -> DoneEvent:
        """The final event, with times filled in (seconds, from `received_s`)."""
        st = self.stats
        st.total_s = now_s - self.received_s
        if self.first_s is not None:
            st.ttft_s = self.first_s - self.received_s
            decode_s = self.last_s - self.first_s
            if decode_s > 0:
                st.tokens_per_s = (st.generated_tokens - self.first_step_tokens) / decode_s
        return DoneEvent(self.request.request_id, reason, st)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes allocated by this session's caches (read by other threads: plain ints)."""
        return sum(c.nbytes for c in self.caches)


def new_stats(request: GenerationRequest, mode: str) -> GenerationStats:
    """Empty statistics of a request served in `mode`."""
    return GenerationStats(prompt_tokens=len(request.prompt_tokens), mode=mode)
