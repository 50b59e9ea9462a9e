"""worker.engine.thread.Engine on tiny real models: admission, round-robin sessions, abort,
errors, stop strings, statistics, lifecycle."""
from __future__ import annotations

import threading
from dataclasses import replace

from pathlib import Path

import pytest

from worker.config import EngineConfig
from worker.engine.modes import MODES, Mode
from worker.engine.session import Session, new_stats
from worker.engine.thread import THREAD_NAME, Engine
from worker.engine.types import (
    DoneEvent,
    Draining,
    ErrorEvent,
    GenerationRequest,
    InvalidRequest,
    Overloaded,
    SamplingParams,
    TokenEvent,
)
from worker.detokenize import TextAssembler
from worker.models.dflash_checkpoint import DraftMismatch
from worker.decoding.base import Step

TIMEOUT_S = 30


class Collector:
    """An emit callback that records events and signals the final one."""

    def __init__(self):
        self.events: list = []
        self.done = threading.Event()
        self.first_token = threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, TokenEvent):
            self.first_token.set()
        else:
            self.done.set()

    def wait(self):
        assert self.done.wait(TIMEOUT_S), "request did not finish"
        return self.events[-1]

    @property
    def token_ids(self):
        return [t for e in self.events if isinstance(e, TokenEvent) for t in e.token_ids]

    @property
    def text(self):
        return "".join(e.text for e in self.events if isinstance(e, TokenEvent))


def boom_start(m, cfg, req, sampler):
    """A mode whose generator yields one token, then fails."""
    def steps():
        yield Step([5])
        raise RuntimeError("boom in decode")
    return steps(), []


@pytest.fixture(scope="module")
def engine(tiny_models):
    """llama target with a noisy-copy draft, capacity 2, plus the failing "boom" mode."""
    config = EngineConfig(tiny_models.llama, model_name="tiny", draft_path=tiny_models.llama_near,
                          capacity=2, num_draft_tokens=3)
    with Engine(config, modes={**MODES, "boom": Mode(boom_start)}) as e:
        yield e


@pytest.fixture(scope="module")
def prompt(engine):
    return tuple(engine.encode_prompt("Dzień dobry! Jak się masz?", None))


def req(rid, prompt, max_tokens=20, **kw):
    return GenerationRequest(rid, prompt, max_tokens, **kw)


def run(engine, request):
    c = Collector()
    engine.submit(request, c)
    return c, c.wait()


def test_model_description(engine, tiny_models):
    assert engine.model.name == "tiny"
    assert engine.model.max_context_tokens == tiny_models.max_position_embeddings
    assert (engine.model.draft, engine.model.draft_mode) == ("llama_near", "draft")
    assert engine.ready and engine.alive


def test_concurrent_requests_complete_with_the_same_tokens_as_alone(engine, prompt):
    alone = {mode: run(engine, req(f"alone-{mode}", prompt, 25, mode=mode))[0].token_ids
             for mode in ("plain", "draft")}
    assert alone["plain"] == alone["draft"]  # greedy speculative == plain
    a, b = Collector(), Collector()
    engine.submit(req("a", prompt, 25, mode="plain"), a)
    engine.submit(req("b", prompt, 25, mode="auto"), b)
    done_a, done_b = a.wait(), b.wait()
    assert done_a.finish_reason == done_b.finish_reason == "length"
    assert a.token_ids == b.token_ids == alone["plain"]
    assert done_a.stats.mode == "plain" and done_b.stats.mode == "draft"
    for c, done in ((a, done_a), (b, done_b)):
        st = done.stats
        assert st.generated_tokens == 25 and st.prompt_tokens == len(prompt)
        assert 0 < st.ttft_s <= st.total_s and st.tokens_per_s > 0
        assert c.text == engine._encode_tokenizer.decode(c.token_ids)
    sb = done_b.stats
    assert sb.cycles > 0 and sb.drafted_tokens >= sb.accepted_tokens
    assert sum(sb.accepted_per_position) == sb.accepted_tokens
    assert len(sb.accepted_per_position) == 3 and sb.verify_s > 0
    assert done_a.stats.cycles == 0 and done_a.stats.accepted_per_position == []
    assert engine.load().active_sessions == 0 and engine.load().kv_cache_bytes == 0


def test_abort_frees_capacity_and_emits_cancelled(engine, prompt):
    a, b = Collector(), Collector()
    engine.submit(req("long-a", prompt, 400), a)
    engine.submit(req("long-b", prompt, 400), b)
    with pytest.raises(Overloaded, match="capacity"):
        engine.submit(req("third", prompt), Collector())
    assert engine.abort("long-a") is True
    done = a.wait()
    assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled"
    assert done.stats.generated_tokens < 400
    c, done_c = run(engine, req("third", prompt, 5))  # capacity is free again
    assert done_c.finish_reason == "length"
    assert engine.abort("no-such-request") is False
    engine.abort("long-b")
    assert b.wait().finish_reason == "cancelled"


def test_load_reports_resident_kv_cache_bytes(engine, prompt):
    c = Collector()
    engine.submit(req("kv", prompt, 400), c)
    assert c.first_token.wait(TIMEOUT_S)
    load = engine.load()
    assert load.active_sessions == 1 and load.capacity == 2
    assert load.kv_cache_bytes > 0
    engine.abort("kv")
    c.wait()
    assert engine.load().kv_cache_bytes == 0


def test_stop_string_ends_output_before_it(engine, prompt):
    full, _ = run(engine, req("full", prompt, 30))
    text = full.text
    stop = text[10:13]
    assert stop and stop not in text[:10]
    c, done = run(engine, req("stopped", prompt, 30, stop=("zzz-never", stop)))
    assert done.finish_reason == "stop"
    assert c.text == text[: text.index(stop)]


def test_seeded_requests_reproduce(engine, prompt):
    def sampled(rid, seed, mode):
        return run(engine, req(rid, prompt, 20, mode=mode,
                               sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=seed)))[0].token_ids

    for mode in ("plain", "draft"):
        assert sampled("s1", 7, mode) == sampled("s2", 7, mode)
        assert sampled("s3", 7, mode) != sampled("s4", 8, mode)


def test_exception_in_one_session_does_not_stop_the_others(engine, prompt):
    good, bad = Collector(), Collector()
    engine.submit(req("good", prompt, 30), good)
    engine.submit(req("bad", prompt, 30, mode="boom"), bad)
    err = bad.wait()
    assert isinstance(err, ErrorEvent) and "boom in decode" in str(err.error)
    assert bad.token_ids == [5]
    assert good.wait().finish_reason == "length" and len(good.token_ids) == 30
    # A callback that raises fails its own request only.
    def broken(event):
        raise ValueError("client went away")
    engine.submit(req("broken-emit", prompt, 5), broken)
    _, done = run(engine, req("after", prompt, 5))
    assert done.finish_reason == "length" and engine.alive
    assert engine.load().active_sessions == 0


@pytest.mark.parametrize("change, message", [
    ({"prompt_tokens": ()}, "prompt is empty"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": 600}, r"\+ max_tokens \(600\) = \d+ tokens exceeds the model's context of 512 tokens: "
                          r"ask for max_tokens <= \d+, or leave it unset"),
    ({"prompt_tokens": (1, 99999)}, r"token ids must be in \[0, VOCAB\)"),
    ({"mode": "turbo"}, "unknown mode 'turbo'"),
    ({"mode": "dflash"}, "mode 'dflash' needs a 'dflash' draft model"),
    ({"mode": "uag"}, "mode 'uag' needs a 'uag' draft model"),
    ({"sampling": SamplingParams(temperature=-1.0)}, "temperature"),
    ({"sampling": SamplingParams(temperature=1.0, top_p=0.0)}, "top_p"),
    ({"stop": ("",)}, "stop strings must be non-empty"),
    ({"request_id": ""}, "request_id is empty"),
])
def test_bad_requests_raise_invalid_request(engine, prompt, change, message, tiny_models):
    # VOCAB: the tiny tokenizer's size
    with pytest.raises(InvalidRequest, match=message.replace("VOCAB", str(tiny_models.vocab_size))):
        engine.submit(replace(req("bad", prompt), **change), Collector())
    assert engine.load().active_sessions == 0


def test_duplicate_request_id_is_rejected(engine, prompt):
    c = Collector()
    engine.submit(req("dup", prompt, 400), c)
    with pytest.raises(InvalidRequest, match="already running"):
        engine.submit(req("dup", prompt), Collector())
    engine.abort("dup")
    c.wait()


def test_encode_prompt_renders_chat_template(engine):
    tok = engine._encode_tokenizer
    ids = engine.encode_prompt(None, [{"role": "system", "content": "Bądź miły."},
                                      {"role": "user", "content": "Cześć 🙂"}])
    expected = "<|im_start|>system\nBądź miły.<|im_end|>\n<|im_start|>user\nCześć 🙂<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == expected
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(engine.encode_prompt("zwykły tekst", None)) == "zwykły tekst"


@pytest.mark.parametrize("prompt, messages, message", [
    (None, None, "exactly one of prompt or messages"),
    ("text", [{"role": "user", "content": "x"}], "exactly one"),
    ("", None, "non-empty string"),
    (None, [], "non-empty list"),
    (None, "hello", "non-empty list"),
    (None, [{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object"),
    (None, [{"content": "a"}], r"messages\[0\]\.role must be one of system, user, assistant, tool; got None"),
    (None, [{"role": "wizard", "content": "a"}], r"messages\[0\]\.role .* got 'wizard'"),
    (None, [{"role": "user"}], r"messages\[0\]\.content must be a string; got NoneType"),
    (None, [{"role": "user", "content": ["a"]}], r"messages\[0\]\.content must be a string; got list"),
])
def test_encode_prompt_rejects_malformed_input(engine, prompt, messages, message):
    with pytest.raises(InvalidRequest, match=message):
        engine.encode_prompt(prompt, messages)


def test_session_hides_eos_and_finishes_with_stop(engine):
    """An EOS token is counted but not emitted, and ends the request with "stop"."""
    events = []
    request = req("eos", (1, 2, 3), 10)
    tok = engine._encode_tokenizer
    eos = 2
    a, b, c, d = (tok.convert_tokens_to_ids(ch) for ch in "abcd")
    s = Session(request, events.append, iter(()), [], TextAssembler(tok), frozenset({eos}), 0.0,
                new_stats(request, "draft"))
    s.on_step(Step([a, b, c], drafted=3, accepted=2), 1.0)
    assert not s.done_reason
    s.on_step(Step([d, eos], drafted=3, accepted=1), 2.0)
    assert s.done_reason == "stop"
    assert [(e.token_ids, e.text) for e in events] == [((a, b, c), "abc"), ((d,), "d")]
    st = s.done_event("stop", 3.0).stats
    assert (st.generated_tokens, st.cycles, st.drafted_tokens, st.accepted_tokens) == (5, 2, 6, 3)
    assert st.accepted_per_position == [2, 1, 0]
    assert (st.ttft_s, st.total_s, st.tokens_per_s) == (1.0, 3.0, 2.0)


def test_plain_only_engine_auto_mode_and_draft_refused(tiny_models):
    config = EngineConfig(tiny_models.qwen2, warmup=False, max_context_tokens=64)
    with Engine(config) as e:
        assert e.model.max_context_tokens == 64 and e.model.draft_mode == ""
        prompt = tuple(e.encode_prompt("Hello", None))
        with pytest.raises(InvalidRequest, match="mode 'draft' needs a 'draft' draft model; this worker has no draft"):
            e.submit(req("d", prompt, mode="draft"), Collector())
        c, done = run(e, req("auto", prompt, 12))
        assert done.finish_reason == "length" and done.stats.mode == "plain" and len(c.token_ids) == 12


def test_close_cancels_running_requests_and_joins_thread(tiny_models):
    e = Engine(EngineConfig(tiny_models.llama, warmup=False))
    assert any(t.name == THREAD_NAME and t.daemon for t in threading.enumerate())
    prompt = tuple(e.encode_prompt("Hello", None))
    c = Collector()
    e.submit(req("running", prompt, 450), c)
    assert c.first_token.wait(TIMEOUT_S)
    e.close()
    assert c.wait().finish_reason == "cancelled"
    assert not e.alive and not e.ready
    with pytest.raises(Draining):
        e.submit(req("late", prompt), Collector())
    e.close()  # idempotent


def test_startup_errors_are_clear(tiny_models, tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory .*missing.* does not exist"):
        Engine(EngineConfig(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        Engine(EngineConfig(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="draft model directory"):
        Engine(EngineConfig(tiny_models.llama, draft_path=tmp_path / "nodraft"))
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_models.llama / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(RuntimeError, match="engine failed to start"):
        Engine(EngineConfig(broken, warmup=False))
    smol_draft = Path(__file__).resolve().parents[1] / "flashfleet" / "drafts" / "SmolLM2-135M-Instruct"
    with pytest.raises(DraftMismatch, match="hidden_size 576 != target hidden size 64"):
        Engine(EngineConfig(tiny_models.llama, draft_path=smol_draft, warmup=False))


def test_long_prefill_does_not_block_other_sessions_and_can_be_aborted(tiny_models):
    """A long prompt is prefilled one chunk per engine turn: a short request submitted after it
    finishes first, and aborting the long one mid-prefill frees its slot."""
    import queue as _queue
    import time as _time

    from worker.engine.types import DoneEvent as _Done
    cfg = EngineConfig(model_path=tiny_models.llama, prefill_step_tokens=8, capacity=2, prompt_cache_entries=0)
    with Engine(cfg) as engine:
        long_prompt = tuple(3 + i % (tiny_models.vocab_size - 3) for i in range(400))
        order: _queue.Queue = _queue.Queue()
        engine.submit(GenerationRequest("long", long_prompt, 4),
                      lambda ev: order.put(("long", type(ev).__name__)))
        engine.submit(GenerationRequest("short", (5, 6, 7), 2),
                      lambda ev: isinstance(ev, _Done) and order.put(("short", ev.finish_reason)))
        # The short request ends before the long one's first token (its 50 prefill chunks).
        assert order.get(timeout=60) == ("short", "length")
        events = [order.get(timeout=60) for _ in range(5)]
        assert events[-1] == ("long", "DoneEvent")
        engine.submit(GenerationRequest("long2", long_prompt, 4),
                      lambda ev: isinstance(ev, _Done) and order.put(("long2", ev.finish_reason)))
        _time.sleep(0.05)
        assert engine.abort("long2")
        assert order.get(timeout=60) == ("long2", "cancelled")
        assert engine.load().active_sessions == 0


def test_fused_projections_engine_gives_the_unfused_engines_tokens(tiny_models):
    """The default engine fuses q/k/v and gate/up (worker/fusion.py); qwen2 has projection biases."""
    assert EngineConfig(tiny_models.qwen2).fuse_projections
    outs = {}
    for fuse in (True, False):
        with Engine(EngineConfig(tiny_models.qwen2, warmup=False, fuse_projections=fuse)) as e:
            prompt = tuple(e.encode_prompt("Dzień dobry! def f(x):", None))
            c, done = run(e, req(f"fuse-{fuse}", prompt, 24, mode="plain"))
            assert done.finish_reason in ("length", "stop")
            outs[fuse] = c.token_ids
    assert outs[True] == outs[False] and len(outs[True]) > 0


@pytest.mark.parametrize("mode", ["plain", "draft"])
def test_resumed_request_continues_the_stream_it_takes_over(engine, prompt, mode):
    """Session migration's worker side: a request resumed after the tokens (and text) another
    worker streamed produces exactly the rest of the unmigrated output."""
    full_c, full_done = run(engine, req(f"full-{mode}", prompt, 30, mode=mode))
    full = full_c.token_ids
    events = [e for e in full_c.events if isinstance(e, TokenEvent)]
    cut = len(events) // 2  # the client saw the first `cut` events' tokens and text
    seen_ids = tuple(t for e in events[:cut] for t in e.token_ids)
    seen_text = "".join(e.text for e in events[:cut])
    assert 0 < len(seen_ids) < 30
    c, done = run(engine, req(f"resumed-{mode}", prompt, 30, mode=mode, resume_tokens=seen_ids,
                              resume_text=seen_text))
    assert list(seen_ids) + c.token_ids == full
    assert seen_text + c.text == full_c.text
    assert done.finish_reason == full_done.finish_reason
    assert done.stats.prompt_tokens == len(prompt) + len(seen_ids)
    assert done.stats.generated_tokens == full_done.stats.generated_tokens - len(seen_ids)  # an EOS counts, unseen


def test_bad_resume_is_an_invalid_request(engine, prompt):
    eos = next(iter(engine._encode_tokenizer.eos_token_ids))
    for kw, says in ((dict(resume_tokens=(5,) * 20), "must be fewer than max_tokens"),
                     (dict(resume_tokens=(5, eos)), "end-of-sequence"),
                     (dict(resume_tokens=(5, 6), resume_text="definitely not it"), "not the text"),
                     (dict(resume_text="x"), "resume_text without resume_token_ids")):
        with pytest.raises(InvalidRequest, match=says):
            engine.submit(req("bad-resume", prompt, 20, **kw), Collector())
