"""Structured output's cost and DFlash under a grammar: aggregate tokens/s of json_schema requests
against unconstrained ones, in plain and DFlash modes, at 1 and 8 concurrent sessions, on one
engine (the worker's path: continuous batching, the block-size policy on).

Session i asks for JSON of schema i of tests/data/schemas (constrained: under the schema's
grammar; unconstrained: the same prompt, free text); greedy, at most --max-tokens each. Each
(mode, sessions) pair runs both kinds back to back, --rounds times, in one process; the table
gives tokens, wall time, aggregate tokens/s (prefill included), decode tokens/s (the sessions'
rates after their first token: a schema's output is often shorter than free text, and the prompt's
prefill would otherwise weigh more on it), the constrained/unconstrained ratio of decode tokens/s
and tau (tokens committed per DFlash iteration; "-" where the block policy ran no speculative
cycle, decoding plainly).

    python bench/bench_structured.py --model ~/.cache/flashfleet/models/SmolLM2-135M-Instruct \\
        --draft flashfleet/drafts/SmolLM2-135M-Instruct --sessions 1,8 --max-tokens 96

On a GPU, the same command with MLX's CUDA build (and a larger target, e.g. Qwen2.5-Coder-1.5B-Instruct
with its shipped draft).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

SCHEMAS = Path(__file__).resolve().parent.parent / "tests" / "data" / "schemas"


def run(engine, mode: str, sessions: int, constrained: bool, max_tokens: int, docs: list[dict]) -> dict:
    """One batch of `sessions` requests submitted at once: tokens, wall seconds, decode tokens/s (the
    sum of the sessions' rates after their first token, so a long prompt's prefill does not weigh
    on it) and mean tau."""
    from worker.engine.types import DoneEvent, GenerationRequest, ResponseFormat

    done, stats, lock = threading.Event(), [], threading.Lock()

    def emit(e):
        if isinstance(e, DoneEvent):
            with lock:
                stats.append(e.stats)
                if len(stats) == sessions:
                    done.set()
        elif not hasattr(e, "token_ids"):
            raise RuntimeError(f"request failed: {e}")

    t0 = time.perf_counter()
    for i in range(sessions):
        schema = json.dumps(docs[i % len(docs)]["schema"])
        prompt = engine.encode_prompt(None, [{"role": "user", "content": f"Reply in JSON matching: {schema}"}])
        fmt = ResponseFormat("json_schema", schema) if constrained else None
        engine.submit(GenerationRequest(f"{mode}-{sessions}-{constrained}-{i}-{t0}", tuple(prompt), max_tokens,
                                        mode=mode, response_format=fmt), emit)
    done.wait()
    wall = time.perf_counter() - t0
    tokens = sum(s.generated_tokens for s in stats)
    cycles = sum(s.cycles for s in stats)
    tau = sum(s.accepted_tokens + s.cycles for s in stats) / cycles if cycles else None  # None: no cycle ran
    decode = sum(s.tokens_per_s for s in stats)
    return {"tokens": tokens, "wall": wall, "decode": decode, "tau": tau}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True, help="a DFlash draft directory")
    ap.add_argument("--sessions", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()

    from worker.config import EngineConfig
    from worker.engine.thread import Engine

    docs = [json.loads(p.read_text()) for p in sorted(SCHEMAS.glob("*.json"))]
    counts = [int(x) for x in args.sessions.split(",")]
    with Engine(EngineConfig(model_path=Path(args.model), draft_path=Path(args.draft), capacity=max(counts),
                             prompt_cache_entries=0)) as engine:
        print("| mode | sessions | kind | tokens | wall s | agg tok/s | decode tok/s | json/free decode | tau |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
        for mode in ("plain", "dflash"):
            for n in counts:
                best = {}
                for _ in range(args.rounds):
                    for constrained in (False, True):
                        r = run(engine, mode, n, constrained, args.max_tokens, docs)
                        key = "json_schema" if constrained else "free"
                        if key not in best or r["decode"] > best[key]["decode"]:
                            best[key] = r
                free = best["free"]["decode"]
                for key in ("free", "json_schema"):
                    r = best[key]
                    rate = r["tokens"] / r["wall"]
                    ratio = f"{r['decode'] / free:.2f}" if key == "json_schema" else ""
                    tau = "" if mode != "dflash" else "-" if r["tau"] is None else f"{r['tau']:.2f}"
                    print(f"| {mode} | {n} | {key} | {r['tokens']} | {r['wall']:.3f} | {rate:.1f} | {r['decode']:.1f} | {ratio} | {tau} |",
                          flush=True)


if __name__ == "__main__":
    from flashfleet.blas import restart_with_openblas

    restart_with_openblas()  # a CPU computes with the OpenBLAS a worker preloads
    main()
