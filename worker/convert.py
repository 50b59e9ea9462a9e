"""Proto <-> engine dataclass conversions, nothing else."""
from __future__ import annotations

import json

from flashfleet.types import DECODE_MODE_NAMES, DECODE_MODES
from flashfleet.v1 import common_pb2, worker_pb2
from worker.engine.types import (DoneEvent, EngineLoad, GenerationRequest, GenerationStats, InvalidRequest,
                                 ModelDescription, ResponseFormat, SamplingParams, TokenEvent)

FINISH_REASON_PROTO = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
}


def messages_of(request: common_pb2.GenerateRequest) -> list[dict] | None:
    """Chat turns of a request as [{"role", "content"}] (an assistant's with its "tool_calls",
    arguments as objects; a tool result's with its "tool_call_id"), or None for a raw prompt.

    Raises:
        InvalidRequest: a turn's tool_calls_json that is not JSON.
    """
    if request.WhichOneof("input") != "messages":
        return None
    turns = []
    for i, m in enumerate(request.messages.messages):
        turn: dict = {"role": m.role, "content": m.content}
        if m.tool_calls_json:
            try:
                turn["tool_calls"] = json.loads(m.tool_calls_json)
            except ValueError as e:
                raise InvalidRequest(f"messages[{i}].tool_calls_json is not JSON: {e}") from None
        if m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        turns.append(turn)
    return turns


def tools_of(request: common_pb2.GenerateRequest) -> list[dict] | None:
    """The tools a request's model may call (OpenAI's list), or None.

    Raises:
        InvalidRequest: tools_json that is not a JSON list.
    """
    if not request.HasField("tools"):
        return None
    try:
        tools = json.loads(request.tools.tools_json)
    except ValueError as e:
        raise InvalidRequest(f"tools.tools_json is not JSON: {e}") from None
    if not isinstance(tools, list):
        raise InvalidRequest("tools.tools_json must be a JSON list of tools")
    return tools


def _response_format(request: common_pb2.GenerateRequest) -> ResponseFormat | None:
    """The grammar's format: the request's response format, or tool calls only when its tools
    must be called (tool_choice "required" or a named function)."""
    if request.HasField("response_format"):
        return ResponseFormat(request.response_format.type, request.response_format.json_schema)
    if request.HasField("tools") and request.tools.choice in ("required", "function"):
        t = request.tools
        return ResponseFormat("tool_calls", tools=t.tools_json, function=t.function, parallel_calls=t.parallel_calls)
    return None


def generation_request(request: common_pb2.GenerateRequest, prompt_tokens: list[int],
                       max_tokens: int) -> GenerationRequest:
    """Engine request from a validated proto and its prompt token ids."""
    sampling = SamplingParams(
        temperature=request.temperature if request.HasField("temperature") else 0.0,
        top_p=request.top_p if request.HasField("top_p") else 1.0,
        seed=request.seed if request.HasField("seed") else None,
        presence_penalty=request.presence_penalty if request.HasField("presence_penalty") else 0.0,
        frequency_penalty=request.frequency_penalty if request.HasField("frequency_penalty") else 0.0,
        repetition_penalty=request.repetition_penalty if request.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(request.logit_bias.items())))
    return GenerationRequest(request_id=request.request_id, prompt_tokens=tuple(prompt_tokens),
                             max_tokens=max_tokens, sampling=sampling, stop=tuple(request.stop),
                             mode=DECODE_MODE_NAMES[request.mode],
                             resume_tokens=tuple(request.resume_token_ids), resume_text=request.resume_text,
                             import_id=request.import_id,
                             response_format=_response_format(request),
                             top_logprobs=request.top_logprobs if request.HasField("top_logprobs") else -1,
                             prompt_logprobs=request.prompt_logprobs if request.HasField("prompt_logprobs") else -1)


def _logprob_proto(lp) -> common_pb2.TokenLogprob:
    """The TokenLogprob proto of an engine `TokenLogprob` (logprob unset where it is None)."""
    return common_pb2.TokenLogprob(token_id=lp.token_id, token=lp.text, logprob=lp.logprob, top=[
        common_pb2.TopLogprob(token_id=t, token=text, logprob=v) for (t, v), text in zip(lp.top, lp.top_text)])


def chunk_response(event: TokenEvent) -> common_pb2.GenerateResponse:
    """A GenerateResponse carrying one Chunk (text, token ids, log-probabilities) of a TokenEvent."""
    return common_pb2.GenerateResponse(
        request_id=event.request_id,
        chunk=common_pb2.Chunk(text=event.text, token_ids=event.token_ids,
                               logprobs=[_logprob_proto(lp) for lp in event.logprobs],
                               prompt_logprobs=[_logprob_proto(lp) for lp in event.prompt_logprobs]))


def stats_proto(s: GenerationStats) -> common_pb2.GenerationStats:
    """The GenerationStats proto of engine stats (times stay seconds; tau is computed here
    from the counts). queue_s and migrations are the coordinator's to fill in."""
    return common_pb2.GenerationStats(
        prompt_tokens=s.prompt_tokens, generated_tokens=s.generated_tokens, ttft_s=s.ttft_s,
        tokens_per_s=s.tokens_per_s, total_s=s.total_s, mode=s.mode, cycles=s.cycles,
        drafted_tokens=s.drafted_tokens, accepted_tokens=s.accepted_tokens,
        acceptance_length=s.acceptance_length, draft_s=s.draft_s, verify_s=s.verify_s,
        translate_s=s.translate_s,
        accepted_per_position=s.accepted_per_position, cached_tokens=s.cached_tokens,
        preemptions=s.preemptions, transferred_tokens=s.transferred_tokens)


def complete_response(event: DoneEvent, worker_id: str) -> common_pb2.GenerateResponse:
    """The final GenerateResponse of a request: finish reason, stats and the serving worker.

    Raises:
        KeyError: a finish_reason other than "stop", "length" or "cancelled".
    """
    return common_pb2.GenerateResponse(
        request_id=event.request_id,
        complete=common_pb2.Complete(finish_reason=FINISH_REASON_PROTO[event.finish_reason],
                                     stats=stats_proto(event.stats), worker_id=worker_id))


def model_info(m: ModelDescription) -> common_pb2.ModelInfo:
    """The ModelInfo a worker registers with: name, context limit, draft label, the draft's
    decode mode (DECODE_MODE_AUTO when there is no draft) and the KV bytes per token of context
    (target's plus draft's; 0 when the target's is unknown)."""
    kv_per_token = m.kv_bytes_per_token + m.draft_kv_bytes_per_token if m.kv_bytes_per_token else 0
    return common_pb2.ModelInfo(name=m.name, max_context_tokens=m.max_context_tokens,
                                draft=m.draft, draft_mode=DECODE_MODES.get(m.draft_mode or "auto", 0),
                                kv_bytes_per_token=kv_per_token, tool_call_format=m.tool_call_format)


def load_proto(load: EngineLoad, chip: str = "", peak_bandwidth_bytes_per_s: float | None = None
               ) -> worker_pb2.WorkerLoad:
    """The WorkerLoad proto of a heartbeat or GetLoad (free_capacity clamped at 0; KV fields in
    bytes, kv_free_bytes as `EngineLoad.kv_free_bytes`), with the sessions, decode profile and
    prefill cost the engine measured, and the host's chip and peak memory bandwidth (bytes/s;
    None = unknown, sent as 0)."""
    return worker_pb2.WorkerLoad(
        active_sessions=load.active_sessions, capacity=load.capacity,
        free_capacity=max(load.capacity - load.active_sessions, 0),
        kv_cache_bytes=load.kv_cache_bytes, kv_budget_bytes=load.kv_budget_bytes,
        kv_free_bytes=load.kv_free_bytes, prompt_cache_bytes=load.prompt_cache_bytes,
        sessions=[worker_pb2.SessionLoad(request_id=s.request_id, context_tokens=s.context_tokens,
                                         kv_bytes=s.kv_bytes, tokens_per_s=s.tokens_per_s,
                                         speculative_speedup=s.speculative_speedup,
                                         remaining_tokens=s.remaining_tokens,
                                         kv_bytes_per_position=s.kv_bytes_per_position) for s in load.sessions],
        chip=chip, peak_memory_bandwidth_bytes_per_s=peak_bandwidth_bytes_per_s or 0.0,
        decode_profile=[worker_pb2.DecodeCost(batch_size=c.batch_size, context_tokens=c.context_tokens,
                                              seconds=c.seconds, samples=c.samples) for c in load.decode_profile],
        prefill_seconds_per_token=load.prefill_seconds_per_token, kv_layers=load.kv_layers)
