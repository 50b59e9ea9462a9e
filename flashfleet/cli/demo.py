"""`flashfleet demo`: the main job end to end. Fetches the demo model (once, into the cache),
starts a local coordinator and workers, sends the real prompts in flashfleet/prompts/demo.jsonl at
once (the first answer streams live), then prints a table: tokens/s, TTFT, the workers that served
each prompt.

On a GPU (Metal or CUDA) it serves Qwen2.5-Coder-1.5B-Instruct with its shipped DFlash draft,
decodes every prompt a second time plainly, and prints DFlash's speedup over plain decoding beside
each answer. On a CPU it serves SmolLM2-135M-Instruct without a draft and says why: speculative
decoding does not pay there."""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from flashfleet.cli.up import DEFAULT_MODEL, LocalCluster, check_model_ref, stopping_on_signals

# Seconds the cluster's processes get to stop after Ctrl-C (or SIGTERM, SIGHUP) before they are
# killed: the answers still streaming are the demo's own, and no one waits for them any more.
INTERRUPTED_STOP_S = 2.0
GPU_MODEL = "Qwen2.5-Coder-1.5B-Instruct"  # the target whose shipped DFlash draft pays on a GPU
CPU_NOTE = (
    "speculative decoding is off: on a CPU it does not pay. A draft pays where checking a block "
    "of drafted tokens in one forward costs about what one plain step costs, as on a GPU, where "
    "a step is bound by reading the weights; on a CPU the matrix products are bound by arithmetic, "
    "so the forward's time grows with every token it checks, and a draft would have to be right "
    "far more often than the shipped ones are (docs/benchmarks.md). On a Mac or a CUDA machine this "
    f"demo serves {GPU_MODEL} with its DFlash draft and prints the speedup over plain decoding.")


@dataclass(frozen=True)
class DemoPlan:
    """What the demo runs on this machine.

    Attributes:
        model: the model the workers serve (catalog name or directory).
        draft: the workers' --draft ("dflash": the model's shipped DFlash draft) or None.
        workers: worker processes to start.
        compare_plain: also decode every prompt plainly and print DFlash's speedup.
        note: a line to print before starting (why there is no draft), or None.
    """

    model: str
    draft: str | None
    workers: int
    compare_plain: bool
    note: str | None


def on_gpu() -> bool:
    """Whether MLX's default device here is a GPU (Metal, or the CUDA build); the workers the
    demo starts compute on the same device."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def plan_demo(gpu: bool, model: str | None = None, workers: int | None = None) -> DemoPlan:
    """The demo for a machine with (`gpu`) or without a GPU.

    GPU: `model` (default Qwen2.5-Coder-1.5B-Instruct) with its shipped DFlash draft when it has
    one, one worker (it batches every session on the one device), and a plain pass to compare.
    CPU: `model` (default SmolLM2-135M-Instruct) without a draft, 2 workers, and CPU_NOTE.

    Args:
        gpu: whether the workers compute on a GPU (`on_gpu`).
        model: --model, or None for the device's default.
        workers: --workers, or None for the device's default.
    """
    from flashfleet.models.drafts import shipped_draft_dir

    if not gpu:
        return DemoPlan(model or DEFAULT_MODEL, None, workers or 2, False, CPU_NOTE)
    model = model or GPU_MODEL
    if shipped_draft_dir(model) is None:
        return DemoPlan(model, None, workers or 1, False,
                        f"{model} has no shipped DFlash draft (flashfleet models list): plain decoding")
    return DemoPlan(model, "dflash", workers or 1, True, None)


def load_prompts() -> list[dict]:
    """The demo prompts: real inputs (two HumanEval functions, a Wikipedia paragraph, a news item),
    one per line of flashfleet/prompts/demo.jsonl, each with its source. All English: the CPU
    demo's SmolLM2-135M does not understand Polish (its greedy answer loops)."""
    text = resources.files("flashfleet").joinpath("prompts/demo.jsonl").read_text("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@dataclass(frozen=True)
class Answer:
    """One prompt's answer: the whole completion, and the workers that served it in order (more
    than one when the coordinator moved the session mid-stream)."""

    completion: object  # flashfleet.Completion
    workers: tuple[str, ...]


def run_prompts(address: str, model: str, prompts: list[dict], max_tokens: int,
                stream_first=sys.stdout, mode: str = "auto") -> list[Answer]:
    """Sends every prompt concurrently (greedy, `mode`); streams the first answer to `stream_first`.

    Returns:
        One Answer per prompt, in order.

    Raises:
        RuntimeError: any prompt failed (after all of them finished); the message lists each.
    """
    from flashfleet.client import Client, accumulate

    results: list = [None] * len(prompts)
    errors: list = []

    def one(i: int, p: dict) -> None:
        messages = [{"role": "user", "content": f"{p['instruction']}\n\n{p['text']}"}]
        try:
            with Client(address) as client:
                chunks = []
                for chunk in client.generate(model, messages=messages, max_tokens=max_tokens,
                                             session_id=f"demo-{mode}-{i}", mode=mode):
                    chunks.append(chunk)
                    if i == 0 and stream_first is not None:
                        stream_first.write(chunk.text)
                        stream_first.flush()
                completion = accumulate(chunks)
                results[i] = Answer(completion, completion.served_by or (completion.worker_id,))
        except Exception as e:  # reported after the others finish
            errors.append(f"prompt {p['id']}: {e}")

    # daemon: after Ctrl-C the demo exits once its cluster has stopped, not when every stream has ended
    threads = [threading.Thread(target=one, args=(i, p), daemon=True) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return results


def speedup(answer: Answer, plain: Answer) -> float | None:
    """Decode tokens/s of `answer` over those of the same prompt decoded plainly (None when
    either has no decode phase to measure)."""
    a, b = answer.completion.stats.tokens_per_s, plain.completion.stats.tokens_per_s
    return a / b if a > 0 and b > 0 else None


def print_table(prompts: list[dict], answers: list[Answer], out=sys.stdout,
                plain: list[Answer] | None = None) -> None:
    """Writes one row per prompt to `out`: the workers that served it (in order, joined by ">"),
    how many times the coordinator moved it to another worker mid-stream (session migration),
    prompt tokens, those of them the worker's prompt cache held (not prefilled), generated
    tokens, TTFT (ms), decode tokens/s, the decoding mode and finish reason; with `plain` (the
    same prompts decoded plainly), also DFlash's speedup and tau."""
    extra = f" {'vs plain':>8} {'tau':>5}" if plain else ""
    print(f"\n{'prompt':<30} {'workers':<20} {'moves':>5} {'prompt tok':>10} {'cached':>6} {'gen tok':>8} "
          f"{'TTFT ms':>8} {'tok/s':>7}{extra}  mode/finish", file=out)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        r, s = a.completion, a.completion.stats
        row = (f"{p['id'][:30]:<30} {'>'.join(a.workers)[:20]:<20} {s.migrations:>5} {s.prompt_tokens:>10} "
               f"{s.cached_tokens:>6} {s.generated_tokens:>8} {s.ttft_s * 1000:>8.0f} {s.tokens_per_s:>7.1f}")
        if plain:
            x = speedup(a, plain[i])
            row += f" {f'{x:.2f}x' if x else '-':>8} {s.acceptance_length:>5.2f}"
        print(f"{row}  {s.mode}/{r.finish_reason}", file=out)


def ask(address: str, plan: DemoPlan, prompts: list[dict], max_tokens: int) -> list[Answer]:
    """Sends the prompts to the cluster at `address`, streaming the first answer, then prints
    the others, each one's speedup over plain decoding (with `plan.compare_plain`) and the table.

    Returns:
        One Answer per prompt, in order.

    Raises:
        RuntimeError: a prompt failed (`run_prompts`).
    """
    if plan.compare_plain:  # first-call costs (kernel compilation) out of both passes
        for mode in ("auto", "plain"):
            run_prompts(address, plan.model, prompts[:1], 8, None, mode)
    print(f"\nQ: {prompts[0]['instruction']} [{prompts[0]['id']}]\n{prompts[0]['text']}\nA: ", end="", flush=True)
    answers = run_prompts(address, plan.model, prompts, max_tokens)
    plain = run_prompts(address, plan.model, prompts, max_tokens, None, "plain") if plan.compare_plain else None
    for i, (prompt, r) in enumerate(zip(prompts, answers)):
        if i:
            print(f"\n\nQ: {prompt['instruction']} [{prompt['id']}]\nA: {r.completion.text.strip()}")
        if plain:
            x, same = speedup(r, plain[i]), r.completion.token_ids == plain[i].completion.token_ids
            print(f"\n   [{r.completion.stats.mode}: {r.completion.stats.tokens_per_s:.1f} tok/s, "
                  f"plain decoding {plain[i].completion.stats.tokens_per_s:.1f} tok/s: "
                  f"{f'{x:.2f}x' if x else '-'}; "
                  f"{'the same tokens' if same else 'tokens differ: GPU rounding, docs/gpu.md'}]")
    print_table(prompts, answers, plain=plain)
    return answers


def main(argv: list[str]) -> int:
    """Runs the demo (fetching the model first when it is not cached).

    Ctrl-C, SIGTERM and SIGHUP stop it at any point: a fetch leaves nothing installed, and the
    cluster's processes are stopped (killed after `INTERRUPTED_STOP_S`) before it exits.

    Returns:
        The exit status: 0, 1 when the cluster failed to start or a prompt failed, 2 for a
        model that is neither a catalog name nor a model directory, or one that cannot be
        fetched (argparse exits with 2 itself for bad flags), 130 when interrupted.
    """
    p = argparse.ArgumentParser(prog="flashfleet demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"model name or local directory (default: {GPU_MODEL} "
                   f"with its DFlash draft on a GPU, {DEFAULT_MODEL} on a CPU)")
    p.add_argument("--workers", type=int, default=None, help="local workers to start (default: 1 on a GPU, "
                   "2 on a CPU)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens to generate per prompt (default 96)")
    a = p.parse_args(argv)
    for flag in ("workers", "max_tokens"):  # before any process starts
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        with stopping_on_signals(interrupt):  # a closed terminal or a kill stops as Ctrl-C does
            return _run(a)
    except KeyboardInterrupt:
        print("\nflashfleet demo: interrupted; stopped", file=sys.stderr)
        return 130


def _run(a: argparse.Namespace) -> int:
    """`main` after its flags are parsed (`main` documents the exit status)."""
    from flashfleet.models import fetch_model, resolve_model

    try:
        check_model_ref("--model", a.model)
        plan = plan_demo(on_gpu(), a.model, a.workers)
        try:
            resolve_model(plan.model)
        except FileNotFoundError:
            if Path(plan.model).expanduser().is_dir():  # a directory, not a catalog name: nothing to fetch
                raise
            print(f"fetching {plan.model} (once; cached for later runs)...", flush=True)
            fetch_model(plan.model)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"flashfleet demo: {e}", file=sys.stderr)
        return 2
    prompts = load_prompts()
    from flashfleet.blas import openblas_hint

    if plan.note:
        print(f"flashfleet demo: {plan.note}", flush=True)
    if not plan.draft and (hint := openblas_hint()) is not None:  # workers on a Linux CPU
        print(f"flashfleet demo: note: {hint}", file=sys.stderr)
    t0 = time.monotonic()
    try:
        with LocalCluster(plan.model, workers=plan.workers, draft=plan.draft) as cluster:
            try:
                answers = ask(cluster.address, plan, prompts, a.max_tokens)
            except KeyboardInterrupt:  # the streams are the demo's own: stop now, not when they end
                cluster.stop(grace_s=INTERRUPTED_STOP_S)
                raise
    except RuntimeError as e:
        print(f"flashfleet demo: {e}", file=sys.stderr)
        return 1
    served = sorted({w for r in answers for w in r.workers})
    print(f"\n{len(prompts)} prompts in {time.monotonic() - t0:.1f} s, served by {', '.join(served)}")
    return 0
