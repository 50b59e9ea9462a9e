"""Where a DFlash cycle's time goes, piece by piece, with one candidate block and with K rows.

`dflash_generate(branches=K)` verifies K candidate blocks in one forward; on the H200 that forward
costs about what one block's does (bench/bench_batched_verify.py), yet a K-row cycle ran 14-25%
longer end to end (docs/benchmarks.md, "Candidate blocks"). This script runs the cycle of
`worker/spec/dflash.py` (compiled draft, compiled verify, greedy, real target and draft, a real
prompt) for `--cycles` cycles per row count, in these orders (`--modes`):

- `overlap`: as the engine runs it since session 27 (`overlap_draft`): the verdict is computed on
  the device and the next draft queued right behind the verify, before the read-back, so the
  device drafts while the host reads back, trims and builds the next verify;
- `overlap1`: the same work, one submission: the next draft's graph is built before anything is
  handed to the device, then verify and draft go in one `mx.async_eval` (`submit` is then the
  whole hand-over; in `overlap` it is the verify's alone);
- `pipelined`: as the engine ran it before (the next draft launched after the read-back and
  queued with `mx.async_eval`, the verify built while the device drafts, one host sync a
  cycle); gives the cycle's wall time and the host time of each piece between the syncs;
- `engine` / `engine_serial`: `dflash_generate` itself (fixed block, compiled verify and draft,
  `branches` = rows) with `overlap_draft` on / off; only the cycle (one Step to the next) is
  timed, the pieces read 0;
- `split`: a sync after every piece, so each piece's time is its own (host building + device
  work + the wait): draft, verify (the target's choice included), read-back, and the host's
  part of the verdict (`choose_row`, trims).

Every (mode, rows) cell runs once untimed first over the same prompt and cycles (greedy, so the
same shapes: every trace and kernel compile happens there), then `--rounds` timed rounds, each
running every cell once in a rotated order (the machine drifts within a process); the table
gives medians over cycles of each cell's median round, and each cell's cycle over the one-row
`pipelined` cell's of the same round (`split`: its own one-row cell's; paired, so the drift
cancels): the median ratio and its range.
`rows 8 keep0` verifies 8 rows but always keeps row 0 (the one-block outcome; isolates what
keeping another row's cache views costs).

    python bench/bench_cycle_pieces.py --target MODEL --dflash-draft DRAFT [--rows 1 4 8]
        [--cycles 48] [--rounds 3] [--modes overlap pipelined split] [--cases bench/prompts]
        [--corpus code] [--json-out F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PIECES = ("draft_build", "draft_wait", "verify_build", "submit", "verify_wait", "readback", "verdict")


def run_cycles(target, draft, prompt: list[int], rows: int, cycles: int, mode: str, keep0: bool) -> dict:
    """Prefills `prompt` (one uncompiled forward), then runs `cycles` DFlash cycles at the draft's
    block size B, greedy, as `worker.spec.dflash.dflash_generate`'s `spec_cycle` does (no EOS
    stop, the default stream, no `rows_for` fallback).

    Args:
        target: a fused mlx-lm model that `compilable` accepts; draft: a bound DFlash `Model`.
        prompt: token ids (>= 2). rows: candidate blocks per verify (1..B).
        cycles: cycles to run. mode: "overlap", "overlap1", "pipelined", "engine",
            "engine_serial" or "split" (the module docstring).
        keep0: keep row 0 whatever the verdict (the one-block outcome, K rows verified).

    Returns:
        per-cycle lists: `cycle` and one per piece in `PIECES` (seconds, host wall time) and
        `tokens` (committed per cycle, bonus included).

    Raises:
        RuntimeError: the target's verify cannot be compiled. ValueError: K rows that cannot
        run compiled (`CompiledTarget`); the compiled draft falls back to eager by itself.
    """
    if mode.startswith("engine"):
        return engine_cycles(target, draft, prompt, rows, cycles, overlap=mode == "engine")
    import mlx.core as mx

    from worker.capture import HiddenCapture
    from worker.compiled_draft import shared_compiled_draft
    from worker.compiled_forward import compilable, shared_compiled_target
    from worker.sampling import greedy
    from worker.spec.dflash import make_target_cache, verdict

    B = draft.block_size
    tc, dc = make_target_cache(target), draft.make_cache()
    if not compilable(target, tc):
        raise RuntimeError("the target's verify cannot be compiled (compilable() is False)")
    fwd, dfwd = shared_compiled_target(target, draft.target_layer_ids), shared_compiled_draft(draft)
    cap = HiddenCapture(target, draft.target_layer_ids)
    x = mx.array([prompt], dtype=mx.uint32)
    with cap:
        target(x[:, :-1], cache=tc)
    draft.extend_context(cap.hidden(), dc)
    with cap:
        logits = target(x[:, -1:], cache=tc)
    pending, b = cap.hidden(), int(mx.argmax(logits[0, -1]).item())
    mx.eval(pending, [c.state for c in tc], [c.state for c in dc])
    masks = [draft.mask_token_id] * (B - 1)
    out = {k: [] for k in ("cycle", "tokens", *PIECES)}
    now = time.perf_counter

    def launch(b, pending):
        return dfwd(mx.array([[b] + masks], dtype=mx.uint32), pending, dc, rows)

    split, overlap = mode == "split", mode in ("overlap", "overlap1")
    next_blocks = None
    for _ in range(cycles):
        t = {}
        t0 = now()
        if split:
            blocks = launch(b, pending)
            t["draft_build"] = now() - t0
            t1 = now()
            mx.eval(blocks)
            t["draft_wait"] = now() - t1
        else:
            blocks = next_blocks if next_blocks is not None else launch(b, pending)
            t["draft_build"] = 0.0 if next_blocks is not None else now() - t0
            t["draft_wait"] = 0.0
        t1 = now()
        logits, taps = fwd(blocks, tc)
        tok = greedy(logits[0])[None] if rows == 1 else greedy(logits)
        v = verdict(blocks[:1], tok[:1]) if keep0 else verdict(blocks, tok)
        t["verify_build"] = now() - t1
        t["submit"] = 0.0
        if overlap:  # the next draft queued behind the verify, from the verdict on the device
            t5 = now()
            if mode == "overlap":
                mx.async_eval(v, tok, taps)
                t["submit"] = now() - t5
            t6 = now()
            next_blocks = dfwd.queue(v[2:3], mx.take(taps, v[:1], axis=0), v[1] + 1, B, dc, rows)
            t["draft_build"] += now() - t6
            t7 = now()
            hand_over = ([v, tok, taps] if mode == "overlap1" else []) + ([] if next_blocks is None else [next_blocks])
            if hand_over:
                mx.async_eval(*hand_over)
            t["submit"] += now() - t7
        t2 = now()
        mx.eval(v, tok, taps)
        t["verify_wait"] = now() - t2
        t3 = now()
        (i, j, b), _ = v.tolist(), tok.tolist()  # the engine reads the tokens too
        t["readback"] = now() - t3
        t4 = now()
        if rows > 1:
            fwd.choose_row(tc, i)
        for c in tc:
            c.trim(B - 1 - j)
        if overlap and next_blocks is not None:
            for c in dc:
                c.offset += j + 1
        else:  # the serial orders, or a draft `queue` could not run compiled: draft after the read-back
            pending = taps[i: i + 1, : j + 1]
        t["verdict"] = now() - t4
        if mode == "pipelined":  # the engine before session 27: the next draft after the read-back
            t5 = now()
            next_blocks = launch(b, pending)
            mx.async_eval(next_blocks)
            t["draft_build"] += now() - t5
        t["cycle"] = now() - t0
        for k, val in t.items():
            out[k].append(val)
        out["tokens"].append(j + 1)
    if next_blocks is not None:
        mx.eval(next_blocks)
    return out


def engine_cycles(target, draft, prompt: list[int], rows: int, cycles: int, overlap: bool) -> dict:
    """`cycles` cycles of `dflash_generate` (greedy, no EOS, the draft's block size, compiled
    verify and draft, `branches=rows`, `overlap_draft=overlap`), timed Step to Step; the result
    as `run_cycles` gives it, with every piece 0."""
    from worker.sampling import greedy
    from worker.spec.dflash import dflash_generate

    gen = dflash_generate(prompt, cycles * draft.block_size + 1, greedy, (), target=target, draft=draft,
                          compile_target=True, compile_draft=True, branches=rows, overlap_draft=overlap)
    out = {k: [] for k in ("cycle", "tokens", *PIECES)}
    next(gen)  # the prefill's token
    t = time.perf_counter()
    for _ in range(cycles):
        step = next(gen)
        now = time.perf_counter()
        out["cycle"].append(now - t)
        out["tokens"].append(len(step.tokens))
        for p in PIECES:
            out[p].append(0.0)
        t = now
    gen.close()
    return out


def main(argv=None) -> int:
    import mlx.core as mx

    from bench.bench_dflash import CORPORA, load_model, read_prompts
    from worker.fusion import fuse_projections
    from worker.models.dflash_checkpoint import DraftCheckpointError, DraftMismatch, load_dflash_draft

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--dflash-draft", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="candidate rows per verify")
    ap.add_argument("--cycles", type=int, default=48, help="cycles per run (the first 2 are not counted)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (odd: a median round exists)")
    ap.add_argument("--cases", type=Path, default=Path(__file__).resolve().parent / "prompts")
    ap.add_argument("--corpus", default="code", choices=sorted(CORPORA))
    ap.add_argument("--contexts", type=int, nargs="+", default=[0],
                    help="context lengths to run at: 0 = the prompt as it is; N = other prompts of the corpus "
                         "put before it until it has at least N tokens (a longer KV cache)")
    ap.add_argument("--modes", nargs="+", default=["overlap", "pipelined", "split"],
                    choices=["overlap", "overlap1", "pipelined", "engine", "engine_serial", "split"])
    ap.add_argument("--no-keep0", dest="keep0", action="store_false",
                    help="leave out the 'rows K keep0' cells")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    if min(a.rows) < 1 or a.cycles < 3 or a.rounds < 1 or a.rounds % 2 == 0:
        ap.error("--rows >= 1, --cycles >= 3, --rounds odd and >= 1")

    target, tokenizer = load_model(a.target, False, getattr(mx, a.dtype))
    fused = fuse_projections(target)
    try:
        draft = load_dflash_draft(a.dflash_draft, target)
    except (DraftCheckpointError, DraftMismatch) as e:
        print(f"bench_cycle_pieces: {e}", file=sys.stderr)
        return 2
    if max(a.rows) > draft.block_size:
        ap.error(f"--rows: at most the block size {draft.block_size}")
    corpus = read_prompts(tokenizer, 64, 1024, a.cases, prompt_set="first")[a.corpus]
    variants = [(r, False) for r in a.rows] + ([(max(a.rows), True)] if max(a.rows) > 1 and a.keep0 else [])
    rows_out = []
    for context in a.contexts:
        prompt = list(corpus[0])
        for other in corpus[1:]:
            if len(prompt) >= context:
                break
            prompt = other + prompt
        cells = [(m, rows, keep0) for m in a.modes for rows, keep0 in variants
                 if not (keep0 and m.startswith("engine"))]
        runs = {c: [] for c in cells}
        for r in range(-1, a.rounds):  # round -1: every trace and kernel compile of these shapes
            # Every cell once per round, the order rotated: the machine drifts within a process
            # (session 26: the same cell's rounds spread 7.3-11.0 ms when run back to back).
            for mode, rows, keep0 in cells[r % len(cells):] + cells[:r % len(cells)]:
                out = run_cycles(target, draft, prompt, rows, a.cycles, mode, keep0)
                if r >= 0:
                    runs[mode, rows, keep0].append(out)
        for (mode, rows, keep0), rounds in runs.items():
            name = f"{rows}{' keep0' if keep0 else ''}"
            per_round = [statistics.median(r["cycle"][2:]) for r in rounds]
            r = rounds[sorted(range(len(rounds)), key=per_round.__getitem__)[len(rounds) // 2]]  # the median round
            med = {k: statistics.median(v[2:]) * 1e3 for k, v in r.items() if k != "tokens"}
            tau = statistics.mean(r["tokens"][2:])
            # Paired with the same round's one-row pipelined cell (split: its own): the drift cancels out.
            base = runs.get((mode if mode == "split" else "pipelined", 1, False)) or runs.get((mode, 1, False))
            ratios = sorted(t / statistics.median(one["cycle"][2:]) for t, one in zip(per_round, base)) if base else []
            rows_out.append(dict(context=len(prompt), mode=mode, rows=name, tau=tau, ms=med,
                                 tok_per_s=tau / med["cycle"] * 1e3,
                                 cycle_range_ms=[min(per_round) * 1e3, max(per_round) * 1e3],
                                 x_one_row=ratios[len(ratios) // 2] if ratios else None,
                                 x_one_row_range=[ratios[0], ratios[-1]] if ratios else None))
            print(f"  context {len(prompt)} {mode} rows {name}: cycle {med['cycle']:.2f} ms, tau {tau:.2f}",
                  file=sys.stderr, flush=True)
    print(f"target {a.target} {a.dtype}, fused groups {fused}; draft {a.dflash_draft} (B={draft.block_size}); "
          f"{a.corpus} prompts; {a.cycles} cycles, median of {a.rounds} round(s); "
          f"device {mx.default_device()}; mlx {mx.__version__}")
    print(f"{'context':>7s} {'mode':9s} {'rows':>8s} {'cycle ms':>9s} " + " ".join(f"{p:>12s}" for p in PIECES)
          + f" {'tau':>5s} {'tok/s':>7s} {'rounds ms':>12s} {'x 1 row (range)':>18s}")
    for r in rows_out:
        lo, hi = r["cycle_range_ms"]
        print(f"{r['context']:7d} {r['mode']:9s} {r['rows']:>8s} {r['ms']['cycle']:9.2f} "
              + " ".join(f"{r['ms'][p]:12.2f}" for p in PIECES)
              + f" {r['tau']:5.2f} {r['tok_per_s']:7.1f} {f'{lo:.2f}-{hi:.2f}':>12s}"
              + (f" {r['x_one_row']:6.3f} ({r['x_one_row_range'][0]:.2f}-{r['x_one_row_range'][1]:.2f})"
                 if r["x_one_row"] is not None else ""))
    if a.json_out:
        a.json_out.write_text(json.dumps(dict(argv=sys.argv[1:] if argv is None else list(argv),
                                              device=str(mx.default_device()), mlx=mx.__version__,
                                              rows=rows_out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
