"""Where a batched engine's time goes, iteration by iteration: the engine in-process serving the
demo's four prompts at once (flashfleet/prompts/demo.jsonl), every scheduler iteration timed
(decode by mode, batch size and block size; prefill), in passes DFlash, plain, DFlash again, then
one prompt alone each way. A shape's first iteration shows as the maximum of its row; the wall
times of the passes compare the modes side by side.

    python bench/bench_iterations.py --model ~/.cache/flashfleet/models/Qwen2.5-Coder-1.5B-Instruct \
        --draft flashfleet/drafts/Qwen2.5-Coder-1.5B-Instruct --max-tokens 96
"""
from __future__ import annotations

import argparse
import collections
import queue
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashfleet.cli.demo import load_prompts  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.engine import scheduler as S  # noqa: E402
from worker.engine.thread import Engine  # noqa: E402
from worker.engine.types import DoneEvent, GenerationRequest, TokenEvent  # noqa: E402

RECORDS: list[tuple[str, str, int, int, float]] = []  # (kind, mode, batch, block, seconds)


def _timed_scheduler() -> None:
    """Wraps the scheduler's decode, block choice, prefill and iteration with timers (this
    process only: the benchmark's own instrumentation)."""
    decode, block_for, prefill, iterate = (S.Scheduler._decode, S.Scheduler._block_for,
                                           S.Scheduler._prefill_chunk, S.Scheduler.iterate)

    def timed_decode(self, mode):
        self.bench_block, batch, t = 1, len(self.decoding[mode]), time.perf_counter()
        decode(self, mode)
        RECORDS.append(("decode", mode, batch, self.bench_block, time.perf_counter() - t))

    def timed_block_for(self, seqs):
        self.bench_block = block_for(self, seqs)
        return self.bench_block

    def timed_prefill(self):
        busy, t = len(self.prefilling), time.perf_counter()
        prefill(self)
        if busy:
            RECORDS.append(("prefill", "", busy, 0, time.perf_counter() - t))

    def timed_iterate(self):
        t = time.perf_counter()
        iterate(self)
        RECORDS.append(("iterate", "", 0, 0, time.perf_counter() - t))

    S.Scheduler._decode, S.Scheduler._block_for = timed_decode, timed_block_for
    S.Scheduler._prefill_chunk, S.Scheduler.iterate = timed_prefill, timed_iterate


def run_pass(engine: Engine, name: str, prompts: list[dict], mode: str, max_tokens: int) -> None:
    """Submits every prompt at once in `mode`, waits for all, prints per-request and
    per-iteration-shape times (milliseconds)."""
    RECORDS.clear()
    events: queue.Queue = queue.Queue()
    t0 = time.perf_counter()
    first, count, stats = {}, collections.Counter(), {}
    for i, p in enumerate(prompts):
        ids = tuple(engine.encode_prompt(None, [{"role": "user", "content": f"{p['instruction']}\n\n{p['text']}"}]))
        engine.submit(GenerationRequest(f"{name}-{i}", ids, max_tokens, mode=mode), events.put)
    done = 0
    while done < len(prompts):
        ev = events.get(timeout=600)
        now = time.perf_counter() - t0
        if isinstance(ev, TokenEvent):
            first.setdefault(ev.request_id, now)
            count[ev.request_id] += len(ev.token_ids)
        elif isinstance(ev, DoneEvent):
            stats[ev.request_id] = (now, ev.stats)
            done += 1
        else:
            raise ev.error
    wall = time.perf_counter() - t0
    shapes = collections.defaultdict(list)
    for kind, m, batch, block, s in RECORDS:
        shapes[(kind, m, batch if kind == "decode" else 0, block)].append(s)
    print(f"\n{name}: mode {mode}, {len(prompts)} prompt(s) x {max_tokens} tokens: wall {wall * 1000:.0f} ms")
    print("| request | TTFT ms | end ms | tokens | tok/s | tau | cycles |\n|---|---:|---:|---:|---:|---:|---:|")
    for rid, (end, st) in sorted(stats.items()):
        print(f"| {rid} | {first.get(rid, 0) * 1000:.0f} | {end * 1000:.0f} | {count[rid]} | {st.tokens_per_s:.1f} | "
              f"{st.acceptance_length:.2f} | {st.cycles} |")
    print("| step | mode | batch | block | n | total ms | mean ms | max ms |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for key in sorted(shapes):
        v = shapes[key]
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {len(v)} | {sum(v) * 1000:.1f} | "
              f"{sum(v) / len(v) * 1000:.2f} | {max(v) * 1000:.1f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="target model directory")
    p.add_argument("--draft", type=Path, required=True, help="DFlash draft directory")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--capacity", type=int, default=8)
    args = p.parse_args()
    _timed_scheduler()
    with Engine(EngineConfig(model_path=args.model, draft_path=args.draft, capacity=args.capacity)) as engine:
        prompts = load_prompts()
        run_pass(engine, "warm-dflash", prompts[:1], "dflash", 8)
        run_pass(engine, "warm-plain", prompts[:1], "plain", 8)
        run_pass(engine, "dflash", prompts, "dflash", args.max_tokens)
        run_pass(engine, "plain", prompts, "plain", args.max_tokens)
        run_pass(engine, "dflash-again", prompts, "dflash", args.max_tokens)
        run_pass(engine, "dflash-alone", prompts[:1], "dflash", 2 * args.max_tokens)
        run_pass(engine, "plain-alone", prompts[:1], "plain", 2 * args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
