"""`flashfleet generate "PROMPT"`: stream one answer from a running cluster to the terminal."""
from __future__ import annotations

import argparse
import sys
import uuid

from flashfleet.cli._common import add_connection_args, credentials, explain
from flashfleet.config import ConfigError
from flashfleet.errors import FlashfleetError


def _bias(text: str) -> tuple[int, float]:
    """--logit-bias's TOKEN_ID=BIAS -> (token id, bias).

    Raises:
        argparse.ArgumentTypeError: not an integer, "=", and a number (argparse prints it)."""
    token, sep, bias = text.partition("=")
    try:
        if sep:
            return int(token), float(bias)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 50256=-100), got {text!r}")


def main(argv: list[str]) -> int:
    """Streams the answer to stdout, then one summary line (finish reason, worker, token
    counts, TTFT in ms, tokens/s, and tau and acceptance rate for speculative modes) to stderr.

    Returns:
        The exit status: 0, 1 on an SDK or config error (printed to stderr), 130 on Ctrl-C.
    """
    p = argparse.ArgumentParser(prog="flashfleet generate", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompt", help="the user's message (or raw text with --raw)")
    add_connection_args(p)
    # "%(default).0s" prints nothing: it stops the formatter adding "(default: None)" to flags
    # whose unset value the help text explains.
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name (flashfleet status)")
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, no chat template")
    p.add_argument("--system", default=None, help="system message%(default).0s")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens to generate (unset: 256, capped by the context the prompt leaves)%(default).0s")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (0 or unset: greedy, the target's own output)%(default).0s")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling: keep the smallest set of tokens whose probability reaches this, "
                        "in (0, 1] (unset: 1)%(default).0s")
    p.add_argument("--seed", type=int, default=None,
                   help="makes sampling reproducible (unset: a fresh random seed)%(default).0s")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help="in [-2, 2]: subtracted from the logit of every token the answer holds%(default).0s")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help="in [-2, 2]: subtracted once per time the answer holds a token%(default).0s")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="in (0, 10]: divides the positive logits of the prompt's and answer's tokens "
                        "(unset: 1, none)%(default).0s")
    p.add_argument("--logit-bias", action="append", default=[], type=_bias, metavar="TOKEN_ID=BIAS",
                   help="add BIAS, in [-100, 100], to that token's logit (repeat for several)%(default).0s")
    p.add_argument("--stop", action="append", default=[],
                   help="end the answer before this string (repeat for several)%(default).0s")
    p.add_argument("--session-id", default="", help="requests of one session go to the same worker")
    p.add_argument("--mode", default="auto", choices=["auto", "plain", "draft", "dflash", "uag"],
                   help="decoding mode: auto uses the worker's draft, plain none")
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline of the whole answer, seconds")
    p.add_argument("--request-id", default="",
                   help="the request's id (default: a new one, printed to stderr first: `flashfleet move` takes it)")
    a = p.parse_args(argv)
    from flashfleet.client import Client

    if a.raw:
        kwargs = {"prompt": a.prompt}
    else:
        messages = ([{"role": "system", "content": a.system}] if a.system else [])
        kwargs = {"messages": messages + [{"role": "user", "content": a.prompt}]}
    request_id = a.request_id or uuid.uuid4().hex
    print(f"-- request {request_id}", file=sys.stderr, flush=True)
    try:
        last, text_ended_line = None, False
        with Client(a.address, credentials=credentials(a.config)) as client:
            for chunk in client.generate(a.model, max_tokens=a.max_tokens, temperature=a.temperature,
                                         top_p=a.top_p, seed=a.seed, stop=a.stop,
                                         session_id=a.session_id, mode=a.mode,
                                         presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                                         repetition_penalty=a.repetition_penalty,
                                         logit_bias=dict(a.logit_bias) if a.logit_bias else None,
                                         timeout_s=a.timeout_s, request_id=request_id, **kwargs):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.text:
                    text_ended_line = chunk.text.endswith("\n")
                last = chunk
    except (FlashfleetError, ConfigError) as e:
        print(f"{chr(10) if last else ''}flashfleet generate: {explain(e, a.address)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n(cancelled)", file=sys.stderr)
        return 130
    if not text_ended_line:  # piped output ends with a whole line
        sys.stdout.write("\n")
        sys.stdout.flush()
    s = last.stats
    extra = (f", tau {s.acceptance_length:.2f}, acceptance {s.acceptance_rate:.0%}"
             if s.cycles else "")
    if s.migrations:
        extra += f"; moved {s.migrations}x between workers (times are the last worker's)"
    print(f"-- {last.finish_reason}; worker {last.worker_id}; {s.prompt_tokens} prompt + "
          f"{s.generated_tokens} generated tokens; TTFT {s.ttft_s * 1000:.0f} ms; "
          f"{s.tokens_per_s:.1f} tok/s; mode {s.mode}{extra}", file=sys.stderr)
    return 0
