"""`flashfleet` command line: a thin dispatcher. Each subcommand lives in its own module with a
`main(argv) -> int` and is imported only when used, so `flashfleet --help` never loads MLX."""
from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {
    "demo": ("flashfleet.cli.demo", "start a local cluster and answer the prompts in prompts/demo.jsonl "
             "(on a GPU with DFlash and its speedup over plain decoding)"),
    "up": ("flashfleet.cli.up", "start a coordinator and N workers on this machine"),
    "generate": ("flashfleet.cli.generate", "stream one generation from a running cluster"),
    "status": ("flashfleet.cli.status", "show the workers of a running cluster"),
    "drain": ("flashfleet.cli.drain", "move every session off a worker, then make it leave"),
    "move": ("flashfleet.cli.move", "move one running request to another worker"),
    "models": ("flashfleet.cli.models_cmd", "fetch / list real models for offline use"),
    "draft": ("flashfleet.cli.draft_cmd", "train and evaluate DFlash drafts for a target "
              "(data, training, tau)"),
    "coordinator": ("coordinator.__main__", "run a coordinator (as a service)"),
    "worker": ("worker.__main__", "run a worker (as a service)"),
}

# Commands that run a server, load models or train: they need the `server` extra
# (`pip install 'flashfleet[server]'`); the others are the client's and need only gRPC.
SERVER_COMMANDS = ("demo", "up", "models", "draft", "coordinator", "worker")
SERVER_PACKAGES = ("mlx", "mlx_lm", "transformers", "tokenizers", "aiohttp", "prometheus_client", "gguf",
                   "numpy", "tqdm", "tenacity", "grpc_health", "grpc_reflection")


def missing_server_packages() -> list[str]:
    """The `server` extra's import names that are not installed here (empty when all are)."""
    from importlib.util import find_spec

    return [name for name in SERVER_PACKAGES if find_spec(name) is None]


INVOKED_AS = "FLASHFLEET_INVOKED_AS"  # a restarted service's usage name (worker/__main__.py)


def prog_name(name: str) -> str:
    """How the service `name` was invoked, for its usage line: `flashfleet NAME` from the console
    script, else `python -m NAME` (or what a restart carried over in INVOKED_AS)."""
    from pathlib import Path

    invoked = os.environ.get(INVOKED_AS, "")
    if invoked.endswith(f" {name}"):  # carried over by this service's own restart
        return invoked
    return f"flashfleet {name}" if Path(sys.argv[0]).name == "flashfleet" else f"python -m {name}"


def usage() -> str:
    """The top-level help text: the usage line and one line per command in COMMANDS."""
    lines = ["usage: flashfleet COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "flashfleet COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs one command; exit status 0 on success, 2 for bad usage, the command's own otherwise.
    A reader that goes away (`flashfleet status | head -1`) ends the command quietly (status 1),
    as the Python docs advise for SIGPIPE, instead of a traceback; so does Ctrl-C where the
    command has no handling of its own (a `models fetch` leaves nothing installed), with the
    shell's status 130."""
    try:
        rc = _dispatch(argv)
        sys.stdout.flush()  # inside the try: a closed pipe fails here, not at interpreter exit
        return rc
    except KeyboardInterrupt:
        args = sys.argv[1:] if argv is None else argv
        name = f"flashfleet {args[0]}" if args and args[0] in COMMANDS else "flashfleet"
        print(f"\n{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the final flush must not raise
        return 1


def _dispatch(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"flashfleet: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if argv[0] in SERVER_COMMANDS and (missing := missing_server_packages()):
        print(f"flashfleet {argv[0]} needs the server packages, and {', '.join(missing)} "
              "is not installed: pip install 'flashfleet[server]' (from a checkout: "
              "pip install -e '.[server]')", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0
