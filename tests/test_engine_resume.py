"""A migrated session whose client has less text than its tokens make (`GenerationRequest.resume_text`
a strict prefix of the text of `resume_tokens`): the engine sends the rest first, as a TokenEvent
with no token ids, then continues the stream (worker.engine.thread `_start_session`)."""
from __future__ import annotations

import threading

import pytest

from worker.config import EngineConfig
from worker.engine.thread import Engine
from worker.engine.types import GenerationRequest, TokenEvent

TIMEOUT_S = 60
MAX_TOKENS = 24


class Collector:
    """An emit callback that records every event and signals the last one (not a TokenEvent)."""

    def __init__(self):
        self.events: list = []
        self.done = threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if not isinstance(event, TokenEvent):
            self.done.set()

    def tokens(self) -> list[TokenEvent]:
        return [e for e in self.events if isinstance(e, TokenEvent)]


def run(engine, request) -> Collector:
    c = Collector()
    engine.submit(request, c)
    assert c.done.wait(TIMEOUT_S), "request did not finish"
    return c


@pytest.fixture(scope="module")
def engine(tiny_models):
    """The tiny llama target alone (plain decoding), capacity 1."""
    with Engine(EngineConfig(tiny_models.llama, model_name="tiny", capacity=1)) as e:
        yield e


def test_resume_text_shorter_than_its_tokens_text_is_sent_before_the_new_tokens(engine):
    prompt = tuple(engine.encode_prompt("Dzień dobry! Jak się masz?", None))
    full = run(engine, GenerationRequest("full", prompt, MAX_TOKENS))
    events = full.tokens()
    full_ids = [t for e in events for t in e.token_ids]
    full_text = "".join(e.text for e in events)
    # the client saw the first `cut` events' tokens, and all of their text but the last character
    cut = next(i for i in range(1, len(events)) if "".join(e.text for e in events[:i]))
    seen_ids = tuple(t for e in events[:cut] for t in e.token_ids)
    seen_text = "".join(e.text for e in events[:cut])
    delivered = seen_text[:-1]

    resumed = run(engine, GenerationRequest("resumed", prompt, MAX_TOKENS, resume_tokens=seen_ids,
                                            resume_text=delivered))
    first, *rest = resumed.tokens()
    assert first.request_id == "resumed" and first.token_ids == ()
    assert first.text and full_text.startswith(delivered + first.text)  # at least the held-back character
    assert list(seen_ids) + [t for e in rest for t in e.token_ids] == full_ids
    assert delivered + first.text + "".join(e.text for e in rest) == full_text
    assert resumed.events[-1].finish_reason == full.events[-1].finish_reason
