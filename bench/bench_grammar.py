"""Grammar libraries for structured output, side by side on one tokenizer: per JSON schema, the
time to compile it and the time of one next-token mask along a valid output (the work a
constrained row adds to each decoding step), for llguidance, xgrammar and outlines-core.

Each library is measured on the same schemas and the same token sequences (a valid instance of
each schema, tokenized); a library that is not installed is left out of the table.

    python bench/bench_grammar.py --tokenizer ~/.cache/flashfleet/models/Qwen2.5-Coder-0.5B-Instruct
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

SCHEMAS = Path(__file__).resolve().parent.parent / "tests" / "data" / "schemas"


def _instances(limit: int) -> list[tuple[str, dict, object]]:
    """(name, schema, a valid instance) of the first `limit` schemas of tests/data/schemas."""
    out = []
    for path in sorted(SCHEMAS.glob("*.json"))[:limit]:
        doc = json.loads(path.read_text())
        out.append((path.stem, doc["schema"], doc["example"]))
    return out


def bench_llguidance(hf, vocab: int, schema: dict, tokens: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    tok = _cached(("llg", id(hf)), lambda: llguidance.hf.from_tokenizer(hf, n_vocab=vocab))
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    matcher = llguidance.LLMatcher(tok, grammar)
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    compile_s = time.perf_counter() - t0
    times = []
    for t in tokens:
        assert matcher.consume_token(t), matcher.get_error()
        t1 = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - t1)
    return compile_s, times


def bench_xgrammar(hf, vocab: int, schema: dict, tokens: list[int]) -> tuple[float, list[float]]:
    import xgrammar as xgr

    compiler = _cached(("xgr", id(hf)), lambda: xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab), cache_enabled=False))
    t0 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
    mask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask)
    compile_s = time.perf_counter() - t0
    times = []
    for t in tokens:
        assert matcher.accept_token(t)
        t1 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t1)
    return compile_s, times


def bench_outlines(hf, vocab: int, schema: dict, tokens: list[int]) -> tuple[float, list[float]]:
    import numpy as np
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    vocabulary = _cached(("oc", id(hf)), lambda: _outlines_vocabulary(hf, Vocabulary))
    t0 = time.perf_counter()
    guide = Guide(Index(build_regex_from_schema(json.dumps(schema)), vocabulary))
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)
    guide.write_mask_into(mask.ctypes.data, mask.size, 4)
    compile_s = time.perf_counter() - t0
    times = []
    for t in tokens:
        guide.advance(t)
        t1 = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        times.append(time.perf_counter() - t1)
    return compile_s, times


def _outlines_vocabulary(hf, Vocabulary):
    """outlines-core's Vocabulary of a byte-level BPE tokenizer: token bytes -> ids (special
    tokens but EOS left out)."""
    decode = {c: b for b, c in _bytes_to_unicode().items()}
    special = set(hf.all_special_ids)
    table: dict[bytes, list[int]] = {}
    for text, i in hf.get_vocab().items():
        if i in special:
            continue
        try:
            key = bytes(decode[c] for c in text)
        except KeyError:
            continue
        table.setdefault(key, []).append(i)
    return Vocabulary(hf.eos_token_id, table)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte's printable stand-in in token strings."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_CACHE: dict = {}


def _cached(key, make):
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


LIBRARIES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a model directory with the tokenizer")
    ap.add_argument("--schemas", type=int, default=10, help="schemas of tests/data/schemas to run")
    ap.add_argument("--libraries", default=",".join(LIBRARIES))
    args = ap.parse_args()
    hf = AutoTokenizer.from_pretrained(args.tokenizer)
    config = json.loads((Path(args.tokenizer) / "config.json").read_text())
    vocab = config["vocab_size"]
    cases = [(name, schema, hf.encode(json.dumps(example), add_special_tokens=False))
             for name, schema, example in _instances(args.schemas)]
    print(f"tokenizer {args.tokenizer} (vocabulary {vocab:,}); {len(cases)} schemas, "
          f"{sum(len(t) for _, _, t in cases)} tokens of valid output")
    print(f"{'library':<14} {'compile ms (median, max)':>26} {'mask us/token (mean, p50, p99)':>32} {'schemas':>8}")
    for name in args.libraries.split(","):
        try:
            __import__({"outlines-core": "outlines_core"}.get(name, name))
        except ImportError:
            print(f"{name:<14} not installed")
            continue
        if name not in LIBRARIES:
            print(f"{name:<14} not measured here (one of {', '.join(LIBRARIES)})")
            continue
        compiles, masks, ok = [], [], 0
        for case, schema, tokens in cases:
            try:
                c, t = LIBRARIES[name](hf, vocab, schema, tokens)
            except Exception as e:  # a schema this library cannot compile
                print(f"  {name}: {case}: {type(e).__name__}: {str(e)[:100]}")
                continue
            compiles.append(c * 1e3)
            masks += [x * 1e6 for x in t]
            ok += 1
        if not masks:
            continue
        masks.sort()
        print(f"{name:<14} {statistics.median(compiles):>14.1f} {max(compiles):>10.1f} "
              f"{statistics.mean(masks):>14.1f} {masks[len(masks) // 2]:>8.1f} {masks[int(len(masks) * 0.99)]:>8.1f} "
              f"{ok:>5}/{len(cases)}")


if __name__ == "__main__":
    main()
