"""The one event type every decoding method yields, so the engine never branches on the method.

A decoding method is a generator function

    def generate(prompt_tokens: list[int], max_tokens: int, sampler: Sampler, eos_ids: set[int],
                 **method_specific) -> Iterator[Step]

that prefills, then yields one `Step` per decode step (plain) or per draft + verify cycle
(speculative). While prefilling a long prompt it may yield empty Steps (`tokens == []`) between
chunks, so the engine can run other sessions and act on an abort (`plain.prefill_steps`). It yields at most `max_tokens` tokens in total, ends after yielding an EOS token
(tokens after it in an accepted run are dropped), and rolls its caches back in `finally`, so the
engine may close it at any point (stop string, cancellation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Container, Iterator, Sequence

import mlx.core as mx

# Sampler: logits (N, V) float -> token ids (N,) uint32. Keeps its own seeded random state, so the
# same seed reproduces the same tokens. Greedy samplers are argmax.
Sampler = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class Step:
    """Tokens committed by one plain decode step or one speculative cycle.

    Attributes:
        tokens: committed token ids in order, all chosen by the target; empty only for a prefill
            chunk (no token yet).
        drafted: draft tokens proposed to the target in this cycle (0 for a plain step).
        accepted: draft tokens the target accepted in this cycle (the bonus token not counted).
        draft_s: wall time of drafting in this cycle, seconds (0 when not measured).
        verify_s: wall time of the target's verify forward, seconds (0 when not measured).
        translate_s: time spent translating tokens between vocabularies (cross-tokenizer drafts
            only), seconds.
        logprobs: one `worker.engine.types.TokenLogprob` per token when the request asked for
            log-probabilities (batched modes), else empty.
    """

    tokens: list[int]
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    translate_s: float = 0.0
    logprobs: tuple = ()


DecodeFn = Callable[..., Iterator[Step]]


def accept_prefix(drafted: Sequence[int], chosen: Sequence[int],
                  eos_ids: Container[int]) -> tuple[int, list[int]]:
    """The acceptance rule of every speculative method here: a draft token is accepted iff it
    equals the target's own choice at its position (argmax, or the target's sample), so the output
    is exactly the target's (Leviathan et al. 2023; Chen et al. 2023, greedy / sample-matching form).

    Args:
        drafted: the proposed tokens d_0..d_{k-1}.
        chosen: the target's choices c_0..c_k at the same positions plus the bonus position.
        eos_ids: tokens that end the generation.

    Returns:
        (n, committed): n = length of the longest prefix with drafted[i] == chosen[i];
        committed = chosen[:n + 1] (the accepted tokens and the bonus), cut after its first EOS.
    """
    n, k = 0, len(drafted)
    while n < k and drafted[n] == chosen[n]:
        n += 1
    committed = list(chosen[: n + 1])
    for i, token in enumerate(committed):
        if token in eos_ids:
            return n, committed[: i + 1]
    return n, committed


def release_buffer_cache(stream=None) -> None:
    """Hands MLX's cached buffers back (`mx.clear_cache`), then waits for the device.

    Why the wait: on MLX's CUDA build (0.32.4, H200) an array made from host data right after
    `clear_cache` failed with "cudaMemcpy ... invalid argument" (training-data generation: every
    second call of `generate_responses` failed); waiting after the clear fixed it, waiting before
    did not. The decode loops make such arrays every cycle (the last token as input) and clear
    every 256 tokens, so they wait too: one device sync per clear. Harmless on Metal and CPU.

    Args:
        stream: the stream the caller's work runs on (waited for as well as the default one).
    """
    mx.clear_cache()
    mx.synchronize()
    if stream is not None:
        mx.synchronize(stream)

