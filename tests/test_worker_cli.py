"""Worker process start-up errors: clear message, non-zero exit, no traceback."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import astuple
from pathlib import Path

import pytest


def test_missing_model_directory_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run([sys.executable, "-m", "worker", "--model", str(missing)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert str(missing) in proc.stderr or "no-such-model" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_model_name_says_how_to_fetch(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "worker", "--model", "Not-A-Model-XYZ"],
                          capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "FLASHFLEET_HOME": str(tmp_path)})
    assert proc.returncode != 0
    assert "Not-A-Model-XYZ" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_help_is_fast_and_lists_commands():
    proc = subprocess.run([sys.executable, "-m", "flashfleet.cli", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    for cmd in ("demo", "up", "generate", "status", "models"):
        assert cmd in proc.stdout
    proc = subprocess.run([sys.executable, "-c", "import flashfleet.cli, flashfleet, sys; "
                           "print('mlx' in ' '.join(sys.modules))"], capture_output=True, text=True)
    assert proc.stdout.strip() == "False", "the SDK and CLI dispatcher must not import MLX"


def test_draft_directory_without_weights_is_a_clear_error(tmp_path, tiny_models):
    draft = tmp_path / "draft-without-weights"
    draft.mkdir()
    (draft / "config.json").write_bytes((tiny_models.llama / "config.json").read_bytes())
    proc = subprocess.run([sys.executable, "-m", "worker", "--model", str(tiny_models.llama), "--draft", str(draft),
                           "--port", "0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    # the error is one line of its own; log lines (such as the OpenBLAS hint) may come before it
    errors = [line for line in proc.stderr.splitlines() if line.startswith("worker:")]
    assert len(errors) == 1 and "draft-without-weights" in errors[0], proc.stderr


@pytest.mark.parametrize("text, fragment", [("{bad", "is not valid JSON"), ("[1, 2]", "must hold a JSON object")])
def test_a_malformed_draft_config_names_the_file(tmp_path, tiny_models, text, fragment):
    draft = tmp_path / "broken-draft"
    draft.mkdir()
    (draft / "config.json").write_text(text)
    proc = subprocess.run([sys.executable, "-m", "worker", "--model", str(tiny_models.llama), "--draft", str(draft),
                           "--port", "0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert f"{draft / 'config.json'} {fragment}" in proc.stderr and "Traceback" not in proc.stderr


def test_fuse_projections_flag_reaches_the_engine_config(tiny_models, monkeypatch):
    import worker.__main__ as cli
    import worker.engine.thread as thread

    seen = []
    monkeypatch.setattr(thread, "Engine", lambda config: seen.append(config) or config)
    for argv, want in (([], True), (["--no-fuse-projections"], False)):
        cli.build_engine(cli.parse_args(["--model", str(tiny_models.llama), *argv]))
        assert seen[-1].fuse_projections is want
    for argv, want in (([], True), (["--no-small-gemm"], False)):
        cli.build_engine(cli.parse_args(["--model", str(tiny_models.llama), *argv]))
        assert seen[-1].small_gemm is want
    for gone in ("--no-compile-forward", "--no-small-attention", "--branches", "--spec-timing-sync"):
        with pytest.raises(SystemExit):
            cli.parse_args(["--model", str(tiny_models.llama), gone])


def test_openblas_preload_applies_only_where_it_should(tmp_path, monkeypatch):
    from flashfleet.blas import openblas_env

    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.setattr(sys, "platform", "linux")
    env = openblas_env({"PATH": "/bin"}, str(lib))
    assert env == {"PATH": "/bin", "LD_PRELOAD": str(lib), "OPENBLAS_NUM_THREADS": "1"}
    assert openblas_env({"OPENBLAS_NUM_THREADS": "2"}, str(lib))["OPENBLAS_NUM_THREADS"] == "2"
    assert openblas_env({"LD_PRELOAD": "/x.so"}, str(lib)) is None  # the user's choice stands
    assert openblas_env({"FLASHFLEET_OPENBLAS": "0"}, str(lib)) is None
    assert openblas_env({}, str(tmp_path / "absent.so")) is None
    monkeypatch.setattr(sys, "platform", "darwin")
    assert openblas_env({}, str(lib)) is None


def test_a_worker_started_by_hand_restarts_itself_with_openblas(monkeypatch):
    """`python -m worker` / `flashfleet worker` on Linux with OpenBLAS installed: main() starts the
    process's own command again with OpenBLAS preloaded, before parsing anything (a library is
    preloaded at process start only); a restarted process, or a program calling main([...]),
    never restarts."""
    import os

    import flashfleet.blas as blas
    import worker.__main__ as cli

    calls = []

    def fake_execve(path, args, env):
        calls.append((path, args, env))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", fake_execve)
    monkeypatch.setattr(blas, "openblas_env", lambda: {"LD_PRELOAD": "/lib/openblas.so", "X": "1"})
    monkeypatch.delenv(cli.INVOKED_AS, raising=False)
    own = ["/usr/bin/python3", "-X", "dev", "/usr/bin/flashfleet", "worker", "--model", "m"]
    monkeypatch.setattr(sys, "orig_argv", own)
    monkeypatch.setattr(sys, "argv", ["/usr/bin/flashfleet", "worker", "--model", "m"])
    with pytest.raises(SystemExit):
        cli.main(["--model", "m"])
    (path, args, env), = calls
    assert path == sys.executable and args == own  # its own command line, flags kept
    assert env["LD_PRELOAD"] == "/lib/openblas.so" and env[cli.INVOKED_AS] == "flashfleet worker"

    missing = str(Path("/nonexistent/model"))
    monkeypatch.setenv(cli.INVOKED_AS, "flashfleet worker")  # already restarted: never again
    assert cli.main(["--model", missing]) == 2 and len(calls) == 1
    monkeypatch.delenv(cli.INVOKED_AS)
    monkeypatch.setattr(sys, "argv", ["/usr/bin/pytest"])  # main([...]) inside another program
    assert cli.main(["--model", missing]) == 2 and len(calls) == 1
    monkeypatch.setattr(blas, "openblas_env", lambda: None)  # nothing to preload: no restart
    monkeypatch.setattr(sys, "argv", ["/usr/bin/flashfleet", "worker"])
    assert cli.main(["--model", missing]) == 2 and len(calls) == 1


@pytest.mark.parametrize("argv, fragment", [
    (["--model", "nope"], "neither a local model directory nor a catalog model"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
])
def test_demo_refuses_bad_arguments_before_fetching_or_starting(argv, fragment, capsys, monkeypatch):
    import flashfleet.cli.demo as demo
    import flashfleet.models as models

    monkeypatch.setattr(models, "fetch_model", lambda *a, **k: pytest.fail("fetched"))
    monkeypatch.setattr(demo, "LocalCluster", lambda *a, **k: pytest.fail("started a cluster"))
    try:
        code = demo.main(argv)
    except SystemExit as e:  # argparse's own error exit
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_demo_with_a_directory_that_is_not_a_model(tmp_path, capsys):
    from flashfleet.cli.demo import main as demo_main

    assert demo_main(["--model", str(tmp_path)]) == 2
    assert "not a model directory" in capsys.readouterr().err


def _answer(workers, migrations, tokens, tps=8.0, mode="plain", tau=0.0):
    from flashfleet.cli.demo import Answer
    from flashfleet.types import Completion, GenerationStats

    stats = GenerationStats(prompt_tokens=12, generated_tokens=tokens, ttft_s=0.25, tokens_per_s=tps,
                            total_s=12.0, mode=mode, migrations=migrations, cached_tokens=tokens // 8,
                            acceptance_length=tau)
    return Answer(Completion(request_id="r", text="x", token_ids=[1] * tokens, finish_reason="length",
                             stats=stats, worker_id=workers[-1]), tuple(workers))


def test_demo_table_names_the_workers_that_served_each_prompt():
    import io

    from flashfleet.cli.demo import print_table

    out = io.StringIO()
    print_table([{"id": "code-1"}, {"id": "pl-2"}],
                [_answer(["worker-1", "worker-2"], 1, 96), _answer(["worker-1"], 0, 40)], out)
    lines = out.getvalue().splitlines()
    assert lines[1].split()[:3] == ["prompt", "workers", "moves"] and "cached" in lines[1].split()
    assert lines[2].split()[:8] == ["code-1", "worker-1>worker-2", "1", "12", "12", "96", "250", "8.0"]
    assert lines[2].split()[-1] == "plain/length"
    assert lines[3].split()[:3] == ["pl-2", "worker-1", "0"]
    assert "vs plain" not in out.getvalue()


def test_demo_table_gives_dflash_speedup_over_the_plain_pass():
    import io

    from flashfleet.cli.demo import print_table

    out = io.StringIO()
    print_table([{"id": "code-1"}], [_answer(["worker-1"], 0, 96, tps=30.0, mode="dflash", tau=3.5)], out,
                plain=[_answer(["worker-1"], 0, 96, tps=12.0)])
    header, row = out.getvalue().splitlines()[1:3]
    assert "vs plain" in header and "tau" in header
    assert row.split()[-3:] == ["2.50x", "3.50", "dflash/length"]


def test_demo_plan_on_a_gpu_serves_the_1_5b_with_its_dflash_draft_and_compares():
    from flashfleet.cli.demo import GPU_MODEL, plan_demo

    plan = plan_demo(gpu=True)
    assert (plan.model, plan.draft, plan.workers, plan.compare_plain, plan.note) == (GPU_MODEL, "dflash", 1, True, None)
    assert astuple(plan_demo(True, "SmolLM2-135M-Instruct", 2))[:4] == ("SmolLM2-135M-Instruct", "dflash", 2, True)
    no_draft = plan_demo(True, "Gemma-3-270M")
    assert (no_draft.draft, no_draft.compare_plain) == (None, False) and "no shipped DFlash draft" in no_draft.note


def test_demo_plan_on_a_cpu_decodes_plainly_and_says_why():
    from flashfleet.cli.demo import CPU_NOTE, plan_demo
    from flashfleet.models import DEFAULT_MODEL

    plan = plan_demo(gpu=False)
    assert (plan.model, plan.draft, plan.workers, plan.compare_plain) == (DEFAULT_MODEL, None, 2, False)
    assert plan.note == CPU_NOTE and "does not pay" in CPU_NOTE and "GPU" in CPU_NOTE
    assert astuple(plan_demo(False, "Qwen2.5-Coder-1.5B-Instruct", 1))[:4] == ("Qwen2.5-Coder-1.5B-Instruct", None, 1, False)


def test_demo_picks_its_plan_from_the_device_and_says_so_on_a_cpu(monkeypatch, capsys):
    """`flashfleet demo` asks MLX for the device (on_gpu) and starts the cluster the plan names;
    on a CPU it prints the note before starting."""
    import flashfleet.cli.demo as demo
    import flashfleet.models as models

    started = []

    class Stop(Exception):
        pass

    def cluster(model, workers, draft):
        started.append((model, workers, draft))
        raise Stop

    monkeypatch.setattr(models, "resolve_model", lambda name: Path("/nonexistent"))
    monkeypatch.setattr(demo, "LocalCluster", cluster)
    for gpu, want in ((False, ("SmolLM2-135M-Instruct", 2, None)), (True, (demo.GPU_MODEL, 1, "dflash"))):
        monkeypatch.setattr(demo, "on_gpu", lambda: gpu)
        with pytest.raises(Stop):
            demo.main([])
        assert started[-1] == want
        out = capsys.readouterr().out
        assert ("speculative decoding is off" in out) == (not gpu)


def test_on_gpu_follows_mlx_default_device():
    import mlx.core as mx

    from flashfleet.cli.demo import on_gpu

    assert on_gpu() == (mx.default_device().type == mx.DeviceType.gpu)

def test_server_commands_without_the_server_extra_name_it(monkeypatch, capsys):
    """Where the server extra is missing, a server command says what to install (exit 2) and a
    client command runs as ever."""
    import flashfleet.cli as cli

    monkeypatch.setattr(cli, "missing_server_packages", lambda: ["mlx", "mlx_lm"])
    for command in cli.SERVER_COMMANDS:
        assert cli.main([command]) == 2
        err = capsys.readouterr().err
        assert f"flashfleet {command} needs the server packages, and mlx, mlx_lm is not installed" in err
        assert "pip install 'flashfleet[server]'" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["status", "--help"])
    assert e.value.code == 0 and "--address" in capsys.readouterr().out
    assert set(cli.SERVER_COMMANDS) < set(cli.COMMANDS)
    monkeypatch.undo()
    assert cli.missing_server_packages() == []  # this environment has the extra


def test_ctrl_c_in_the_demo_stops_its_cluster_at_once_and_says_so(monkeypatch, capsys):
    """Ctrl-C while the demo's prompts stream: its cluster stops without waiting for the answers
    (they are the demo's own), and the demo exits 130 with one line, no traceback."""
    import flashfleet.cli.demo as demo
    import flashfleet.models as models

    stops = []

    class Cluster:
        address = "127.0.0.1:1"

        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            stops.append(None)

        def stop(self, grace_s=None):
            stops.append(grace_s)

    def ask(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "resolve_model", lambda name: Path("/nonexistent"))
    monkeypatch.setattr(demo, "on_gpu", lambda: False)
    monkeypatch.setattr(demo, "LocalCluster", Cluster)
    monkeypatch.setattr(demo, "ask", ask)
    assert demo.main([]) == 130
    assert stops[0] == demo.INTERRUPTED_STOP_S
    err = capsys.readouterr().err
    assert "flashfleet demo: interrupted; stopped" in err and "Traceback" not in err


def test_ctrl_c_in_a_command_is_one_line_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C in a command with no handling of its own (here `flashfleet draft`, stopped in its
    work): exit 130 and one line."""
    import flashfleet.cli as cli
    import flashfleet.cli.draft_cmd as draft_cmd

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(draft_cmd, "main", interrupted)
    assert cli.main(["draft", "train"]) == 130
    assert capsys.readouterr().err.strip() == "flashfleet draft: interrupted"


def test_a_client_command_with_no_coordinator_there_says_what_to_start(capsys):
    from flashfleet.cli import generate
    from flashfleet.cli.up import free_port

    address = f"127.0.0.1:{free_port()}"
    assert generate.main(["hi", "--address", address]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and f"is a coordinator running at {address}? `flashfleet up` starts one" in err
