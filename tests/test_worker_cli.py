"""Worker process start-up errors: clear message, non-zero exit, no traceback."""
from __future__ import annotations

import subprocess
import sys


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
    assert "Traceback" not in proc.stderr and "draft-without-weights" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_fuse_projections_flag_reaches_the_engine_config(tiny_models, monkeypatch):
    import worker.__main__ as cli
    import worker.engine.thread as thread

    seen = []
    monkeypatch.setattr(thread, "Engine", lambda config: seen.append(config) or config)
    for argv, want in (([], True), (["--no-fuse-projections"], False)):
        cli.build_engine(cli.parse_args(["--model", str(tiny_models.llama), *argv]))
        assert seen[-1].fuse_projections is want
