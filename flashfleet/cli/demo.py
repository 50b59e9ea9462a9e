"""`flashfleet demo`: the main job end to end. Fetches the default model (once, into the cache),
starts a local coordinator and 2 workers, sends the real prompts in flashfleet/prompts/demo.jsonl
at once (the first answer streams live), then prints a table: tokens/s, TTFT, which worker."""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from importlib import resources
from pathlib import Path

from flashfleet.cli.up import DEFAULT_MODEL, LocalCluster, check_model_ref


def load_prompts() -> list[dict]:
    """The demo prompts: real inputs from shared/cases (code, English, Polish), one per line."""
    text = resources.files("flashfleet").joinpath("prompts/demo.jsonl").read_text("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_prompts(address: str, model: str, prompts: list[dict], max_tokens: int,
                stream_first=sys.stdout) -> list:
    """Sends every prompt concurrently; streams the first answer to `stream_first`.

    Returns:
        One flashfleet.Completion per prompt, in order.

    Raises:
        RuntimeError: any prompt failed (after all of them finished); the message lists each.
    """
    from flashfleet.client import Client, _accumulate

    results: list = [None] * len(prompts)
    errors: list = []

    def one(i: int, p: dict) -> None:
        messages = [{"role": "user", "content": f"{p['instruction']}\n\n{p['text']}"}]
        try:
            with Client(address) as client:
                chunks = []
                for chunk in client.generate(model, messages=messages, max_tokens=max_tokens,
                                             session_id=f"demo-{i}"):
                    chunks.append(chunk)
                    if i == 0 and stream_first is not None:
                        stream_first.write(chunk.text)
                        stream_first.flush()
                results[i] = _accumulate(chunks)
        except Exception as e:  # reported after the others finish
            errors.append(f"prompt {p['id']}: {e}")

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return results


def print_table(prompts: list[dict], results: list, out=sys.stdout) -> None:
    """Writes one row per prompt to `out`: the worker that finished it, how many times the
    coordinator moved it to another worker mid-stream (session migration), prompt tokens, those of
    them the worker's prompt cache held (not prefilled), generated tokens, TTFT (ms), tokens/s and
    finish reason. `results` are `run_prompts`' Completions, in
    prompt order."""
    print(f"\n{'prompt':<30} {'worker':<10} {'moves':>5} {'prompt tok':>10} {'cached':>6} {'gen tok':>8} {'TTFT ms':>8} "
          f"{'tok/s':>7}  finish", file=out)
    for p, r in zip(prompts, results):
        s = r.stats
        print(f"{p['id'][:30]:<30} {r.worker_id:<10} {s.migrations:>5} {s.prompt_tokens:>10} "
              f"{s.cached_tokens:>6} {s.generated_tokens:>8} {s.ttft_s * 1000:>8.0f} {s.tokens_per_s:>7.1f}  {r.finish_reason}", file=out)


def main(argv: list[str]) -> int:
    """Runs the demo (fetching the model first when it is not cached).

    Returns:
        The exit status: 0, 1 when the cluster failed to start or a prompt failed, 2 for a
        model that is neither a catalog name nor a model directory, or one that cannot be
        fetched (argparse exits with 2 itself for bad flags).
    """
    p = argparse.ArgumentParser(prog="flashfleet demo", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or local directory")
    p.add_argument("--workers", type=int, default=2, help="local workers to start")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens to generate per prompt")
    a = p.parse_args(argv)
    for flag in ("workers", "max_tokens"):  # before any process starts
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    from flashfleet.models import fetch_model, resolve_model

    try:
        check_model_ref("--model", a.model)
        try:
            resolve_model(a.model)
        except FileNotFoundError:
            if Path(a.model).expanduser().is_dir():  # a directory, not a catalog name: nothing to fetch
                raise
            print(f"fetching {a.model} (once; cached for later runs)...", flush=True)
            fetch_model(a.model)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"flashfleet demo: {e}", file=sys.stderr)
        return 2
    prompts = load_prompts()
    from flashfleet.blas import openblas_hint

    if (hint := openblas_hint()) is not None:  # demo workers run on the CPU here unless MLX has CUDA
        print(f"flashfleet demo: note: {hint}", file=sys.stderr)
    t0 = time.monotonic()
    try:
        with LocalCluster(a.model, workers=a.workers) as cluster:
            print(f"\nQ: {prompts[0]['instruction']}\n{prompts[0]['text']}\nA: ", end="", flush=True)
            results = run_prompts(cluster.address, a.model, prompts, a.max_tokens)
            for prompt, r in list(zip(prompts, results))[1:]:
                print(f"\n\nQ: {prompt['instruction']} [{prompt['id']}]\nA: {r.text.strip()}")
            print_table(prompts, results)
    except RuntimeError as e:
        print(f"flashfleet demo: {e}", file=sys.stderr)
        return 1
    print(f"\n{len(prompts)} prompts in {time.monotonic() - t0:.1f} s on "
          f"{len({r.worker_id for r in results})} worker(s)")
    return 0
