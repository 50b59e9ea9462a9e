"""mlx-lm's own greedy decoding as the reference of token-for-token tests, computed as a worker computes.

A worker casts its target to its device's compute dtype at load (`worker.loading.load_target`:
float32 on a CPU, and in the tests everywhere, `$FLASHFLEET_COMPUTE_DTYPE` in conftest.py) and, on
a Linux CPU, runs with OpenBLAS preloaded (`flashfleet.blas`). A reference computed from the
stored weights (bfloat16 for a fetched model) or with another BLAS rounds differently, and greedy
outputs part at the first near tie. So the reference runs in a child process started with the
workers' environment (`flashfleet.cli.up.worker_env`) and loads the model with `load_target`.

Run as a script it is that child: `python tests/mlx_lm_reference.py MODEL_DIR MAX_TOKENS` reads a
JSON list of prompts (token id lists) on stdin and prints a JSON list of outputs.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def greedy_reference(model_dir: str | Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """mlx-lm's `generate_step`, greedy, for each prompt, in the dtype and with the BLAS a worker uses.

    Args:
        model_dir: the model directory (a fetched catalog model or a tiny test model).
        prompts: prompt token ids, one list per prompt.
        max_tokens: tokens generated per prompt at most; a generation stops before an EOS token.

    Returns:
        The generated token ids per prompt (EOS excluded).

    Raises:
        RuntimeError: the child process failed (its stderr's tail in the message).
    """
    from flashfleet.cli.up import worker_env

    env = {**worker_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, str(model_dir), str(max_tokens)], env=env,
                          input=json.dumps(prompts), capture_output=True, text=True, timeout=540)
    if proc.returncode != 0:
        raise RuntimeError(f"mlx-lm reference failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _main(model_dir: str, max_tokens: int) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from worker.loading import load_target

    model, tokenizer = load_target(model_dir)
    eos = set(tokenizer.eos_token_ids)
    outs = []
    for prompt in json.loads(sys.stdin.read()):
        out = []
        for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
            if int(tok) in eos:
                break
            out.append(int(tok))
        outs.append(out)
    print(json.dumps(outs))


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]))
