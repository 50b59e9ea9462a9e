"""DFlash drafts shipped with the package (flashfleet/drafts/<catalog name>/) and the draft keyword
`dflash`: lookup by name or model directory, `flashfleet worker` / `flashfleet up` / cluster config
resolution, the one-line error for a model without one, `models list`, the package-data entry, and
(real model, once the SmolLM2 draft is committed) greedy DFlash output equal to plain greedy.

Lookup tests point `FLASHFLEET_DRAFTS_DIR` at drafts written in tmp_path (a config.json and a
placeholder safetensors file; the lookup never reads weights)."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from flashfleet.models import CATALOG
from flashfleet.models.drafts import (
    DRAFTS_ENV,
    NoShippedDraftError,
    drafts_root,
    is_dflash_draft_dir,
    package_drafts_root,
    resolve_draft_arg,
    shipped_draft_dir,
    shipped_drafts,
)
from real_models import fetched
from tiny_models import CASES_DIR

ROOT = Path(__file__).resolve().parents[1]
SMOL, QWEN05, GEMMA = "SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct", "Gemma-3-270M"


def write_draft(directory: Path, **extra) -> Path:
    """A DFlash draft directory in the published layout; weights are a placeholder file."""
    directory.mkdir(parents=True)
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
              "dflash_config": {"target_layer_ids": [1, 8, 15, 22, 28], "mask_token_id": 2},
              **extra}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"placeholder")
    (directory / "TRAINING.md").write_text("how it was trained\n")
    (directory / "training_card.json").write_text("{}\n")
    return directory


@pytest.fixture
def drafts(tmp_path, monkeypatch) -> Path:
    """A drafts root with shipped drafts for SmolLM2 and Qwen2.5-Coder-0.5B (none for the others),
    and FLASHFLEET_HOME in tmp_path so nothing reads the real model cache."""
    root = tmp_path / "drafts"
    write_draft(root / SMOL)
    write_draft(root / QWEN05, quantization={"group_size": 64, "bits": 4})
    monkeypatch.setenv(DRAFTS_ENV, str(root))
    monkeypatch.setenv("FLASHFLEET_HOME", str(tmp_path / "home"))
    return root


# --------------------------------------------------------------------------- lookup


def test_shipped_drafts_by_catalog_name_any_case(drafts):
    assert drafts_root() == drafts
    assert shipped_drafts() == {SMOL: drafts / SMOL, QWEN05: drafts / QWEN05}
    assert list(shipped_drafts()) == [SMOL, QWEN05]  # catalog order, default model first
    assert shipped_draft_dir(SMOL) == drafts / SMOL
    assert shipped_draft_dir("smollm2-135m-instruct") == drafts / SMOL
    assert shipped_draft_dir("QWEN2.5-CODER-0.5B-INSTRUCT") == drafts / QWEN05
    assert shipped_draft_dir(GEMMA) is None  # catalog model, nothing shipped
    assert shipped_draft_dir("Qwen2.5-Coder-1.5B-Instruct") is None
    assert shipped_draft_dir("Llama-9000") is None  # not a catalog model


def test_only_catalog_named_dflash_drafts_count(tmp_path, monkeypatch):
    root = tmp_path / "drafts"
    monkeypatch.setenv(DRAFTS_ENV, str(root))
    assert shipped_drafts() == {}  # no drafts directory at all
    write_draft(root / "not-a-catalog-model")
    (root / GEMMA).mkdir()  # named right, but empty
    (root / GEMMA / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    (root / GEMMA / "model.safetensors").write_bytes(b"x")  # a causal LM, not a DFlash draft
    write_draft(root / "qwen2.5-coder-1.5b-instruct")  # another case is fine
    (root / "README.md").write_text("a file, not a draft\n")
    assert shipped_drafts() == {"Qwen2.5-Coder-1.5B-Instruct": root / "qwen2.5-coder-1.5b-instruct"}
    assert not is_dflash_draft_dir(root / GEMMA)
    (root / "no-weights").mkdir()
    (root / "no-weights" / "config.json").write_text(json.dumps({"dflash_config": {}}))
    assert not is_dflash_draft_dir(root / "no-weights")


def test_model_directory_by_name_or_fetch_marker(drafts, tmp_path):
    named = tmp_path / "models" / SMOL.lower()
    named.mkdir(parents=True)
    (named / "config.json").write_text("{}")
    assert shipped_draft_dir(named) == drafts / SMOL
    assert shipped_draft_dir(str(named)) == drafts / SMOL
    fetched = tmp_path / "models" / "coder-small"  # a fetched catalog model under another name
    fetched.mkdir()
    (fetched / "flashfleet-model.json").write_text(json.dumps({"sha256": CATALOG[QWEN05].sha256}))
    assert shipped_draft_dir(fetched) == drafts / QWEN05
    other = tmp_path / "models" / "my-model"
    other.mkdir()
    assert shipped_draft_dir(other) is None


def test_default_root_is_the_package_directory(monkeypatch):
    monkeypatch.delenv(DRAFTS_ENV, raising=False)
    import flashfleet

    assert drafts_root() == package_drafts_root() == Path(flashfleet.__file__).resolve().parent / "drafts"


# What a draft in git may weigh: the shipped 3-layer 1.5B draft with MLP 1024 at 4 bits is
# 21.55 MiB; the shipped 5-layer one (65,536-token draft vocabulary) 32.78.
MAX_SHIPPED_DRAFT_MIB = 36


def test_committed_drafts_are_well_formed():
    """Every directory under flashfleet/drafts (none until drafts are committed) is named after a
    catalog model and holds a draft in the published layout, small enough to ship."""
    root = package_drafts_root()
    for entry in sorted(p for p in root.glob("*") if p.is_dir()):
        assert entry.name in CATALOG, f"{entry.name} is not a catalog model name"
        assert is_dflash_draft_dir(entry), f"{entry} is not a DFlash draft"
        config = json.loads((entry / "config.json").read_text())
        assert config["block_size"] >= 2 and "mask_token_id" in config["dflash_config"]
        assert config["dflash_config"]["target_layer_ids"]
        size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
        assert size < MAX_SHIPPED_DRAFT_MIB * 2**20, f"{entry}: {size} bytes"


def test_lookup_imports_no_mlx(drafts):
    code = ("import sys; from flashfleet.models.drafts import shipped_drafts, resolve_draft_arg; "
            f"print(resolve_draft_arg('dflash', {SMOL!r})); "
            "print('mlx' in ' '.join(sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert proc.stdout.split() == [str(drafts / SMOL), "False"], proc.stderr


# --------------------------------------------------------------------------- the keyword


def test_resolve_draft_arg(drafts):
    assert resolve_draft_arg(None, SMOL) is None
    assert resolve_draft_arg("Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct") == QWEN05
    assert resolve_draft_arg("path/to/draft", GEMMA) == "path/to/draft"
    assert resolve_draft_arg("dflash", SMOL) == str(drafts / SMOL)
    assert resolve_draft_arg("DFlash", "smollm2-135m-instruct") == str(drafts / SMOL)
    # a model loaded from an arbitrary directory, served under a catalog name
    assert resolve_draft_arg("dflash", "/srv/weights/v3", QWEN05) == str(drafts / QWEN05)


def test_no_shipped_draft_is_one_line_naming_the_models_that_have_one(drafts, tmp_path, monkeypatch):
    with pytest.raises(NoShippedDraftError) as error:
        resolve_draft_arg("dflash", GEMMA)
    message = str(error.value)
    assert "\n" not in message
    assert GEMMA in message and SMOL in message and QWEN05 in message
    monkeypatch.setenv(DRAFTS_ENV, str(tmp_path / "empty"))
    with pytest.raises(NoShippedDraftError, match="none yet"):
        resolve_draft_arg("dflash", SMOL)


def test_worker_flag_resolves_the_keyword(drafts):
    from worker.__main__ import parse_args

    a = parse_args(["--model", SMOL, "--draft", "dflash"])
    assert a.draft == str(drafts / SMOL)
    assert parse_args(["--model", SMOL, "--draft", "some/dir"]).draft == "some/dir"
    assert parse_args(["--model", SMOL]).draft is None
    with pytest.raises(NoShippedDraftError, match=GEMMA):
        parse_args(["--model", GEMMA, "--draft", "dflash"])


CLUSTER_TOML = f"""
[coordinator]
port = 50051

[[models]]
name = "{SMOL}"
draft = "dflash"

[[models]]
name = "{GEMMA}"
draft = "dflash"

[[models]]
name = "{QWEN05}"

[[workers]]
id = "w1"
model = "{SMOL}"

[[workers]]
id = "w2"
model = "{GEMMA}"

[[workers]]
id = "w3"
model = "{QWEN05}"
"""


def test_cluster_config_draft_keyword(drafts, tmp_path):
    from flashfleet.cli.up import check_shipped_drafts
    from flashfleet.config import load_cluster_config
    from worker.__main__ import parse_args

    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER_TOML)
    assert parse_args(["--config", str(path), "--worker-id", "w1"]).draft == str(drafts / SMOL)
    assert parse_args(["--config", str(path), "--worker-id", "w3"]).draft is None
    assert parse_args(["--config", str(path), "--worker-id", "w3",
                       "--draft", "dflash"]).draft == str(drafts / QWEN05)
    with pytest.raises(NoShippedDraftError, match=GEMMA):
        parse_args(["--config", str(path), "--worker-id", "w2"])
    assert parse_args(["--config", str(path), "--worker-id", "w2", "--model", SMOL]).draft is None

    cfg = load_cluster_config(path)
    check_shipped_drafts(cfg, 1, None, None)  # w1 only
    with pytest.raises(NoShippedDraftError, match=GEMMA):
        check_shipped_drafts(cfg, 2, None, None)
    check_shipped_drafts(cfg, 3, SMOL, "dflash")  # --model/--draft override every entry
    with pytest.raises(NoShippedDraftError, match="Unknown-Model"):
        check_shipped_drafts(cfg, 3, "Unknown-Model", "dflash")


def test_worker_and_up_exit_2_with_one_line(drafts):
    """The real commands: exit code 2 and a one-line message, before anything loads or starts."""
    for argv in (["-m", "worker", "--model", GEMMA, "--draft", "dflash"],
                 ["-m", "flashfleet.cli", "up", "--model", GEMMA, "--draft", "dflash"]):
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert GEMMA in lines[0] and SMOL in lines[0] and QWEN05 in lines[0]


def test_up_passes_the_keyword_to_each_worker(drafts, tmp_path, monkeypatch):
    from flashfleet.cli import up

    spawned = []
    monkeypatch.setattr(up.LocalCluster, "_spawn", lambda self, name, args, env=None: spawned.append(args))
    monkeypatch.setattr(up.LocalCluster, "_wait_ready", lambda self, timeout_s, progress, should_stop: None)
    up.LocalCluster(SMOL, workers=2, port=1, draft="dflash", log_dir=tmp_path).start(progress=lambda m: None)
    workers = [args for args in spawned if args[0] == "worker"]
    assert len(workers) == 2
    assert all(args[args.index("--draft") + 1] == "dflash" for args in workers)


def test_models_list_shows_shipped_drafts(drafts, capsys):
    from flashfleet.cli.models_cmd import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()}
    assert "DFLASH DRAFT" in rows["NAME"]
    assert "shipped" in rows[SMOL] and "shipped" in rows[QWEN05]
    assert "shipped" not in rows[GEMMA] and "shipped" not in rows["Qwen2.5-Coder-1.5B-Instruct"]
    assert str(drafts) in out


# --------------------------------------------------------------------------- packaging


def test_package_data_ships_draft_directories(tmp_path):
    """pyproject.toml's package-data carries flashfleet/drafts/*/*: a wheel built from a copy of
    the package with a draft in it holds every file of the draft."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "drafts/*/*" in pyproject["tool"]["setuptools"]["package-data"]["flashfleet"]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    import shutil

    shutil.copytree(ROOT / "flashfleet", src / "flashfleet",
                    ignore=shutil.ignore_patterns("__pycache__", "drafts"))
    write_draft(src / "flashfleet" / "drafts" / SMOL)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(tmp_path / "out"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "out").glob("flashfleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for file in ("config.json", "model.safetensors", "TRAINING.md", "training_card.json"):
        assert f"flashfleet/drafts/{SMOL}/{file}" in names
    assert "flashfleet/models/drafts.py" in names


# --------------------------------------------------------------------------- real model

SHIPPED_SMOL = package_drafts_root() / SMOL
NEAR_TIE = 0.05  # as tests/test_dflash.py: GPU-only tolerance for logits this close


def case_prompts(count: int = 2, max_chars: int = 1500) -> list[str]:
    """The first row of humaneval.jsonl and of enwiki_en.jsonl in tests/data (code, prose)."""
    prompts = []
    for name in ("humaneval.jsonl", "enwiki_en.jsonl"):
        with (CASES_DIR / name).open(encoding="utf-8") as f:
            prompts.append(json.loads(f.readline())["prompt"][:max_chars])
    return prompts[:count]


def greedy_pairs(model_dir: str, draft_dir: str, max_tokens: int = 24) -> list[dict]:
    """Plain and DFlash greedy tokens of the target on each of `case_prompts()`; where they differ,
    the first differing position, the target's logit gap there and whether it is a near tie."""
    import mlx.core as mx

    from worker.engine.one_sequence import decode
    from worker.loading import load_target
    from worker.models.dflash_checkpoint import load_dflash_draft
    from worker.sampling import greedy
    from worker.decoding import plain

    target, tokenizer = load_target(model_dir)  # the worker's compute dtype, not the stored one
    draft = load_dflash_draft(draft_dir, target)
    results = []
    for text in case_prompts():
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    add_generation_prompt=True))
        ref = [t for s in plain.generate(prompt, max_tokens, greedy, set(), model=target) for t in s.tokens]
        out = [t for s in decode(target, prompt, max_tokens, greedy, (), draft=draft) for t in s.tokens]
        result = {"text": text[:40], "ref": ref, "out": out, "gpu": mx.default_device().type == mx.gpu}
        i = next((k for k, (a, b) in enumerate(zip(out, ref)) if a != b), None)
        if i is not None:
            logits = target(mx.array([prompt + ref[:i]]))[0, -1].astype(mx.float32)
            gap = abs(logits[ref[i]].item() - logits[out[i]].item())
            result.update(at=i, gap=gap, near_tie=gap < NEAR_TIE and
                          logits[ref[i]].item() >= logits.max().item() - NEAR_TIE)
        results.append(result)
    return results


@pytest.mark.real_model
def test_shipped_smollm2_draft_greedy_equals_plain(monkeypatch):
    """The committed SmolLM2 DFlash draft loads against the fetched SmolLM2, and greedy DFlash
    output is plain greedy output, 24 tokens on 2 real prompts. Runs in a child process with the
    workers' environment (OpenBLAS preloaded on Linux: minutes faster on a CPU)."""
    if not SHIPPED_SMOL.is_dir():
        pytest.skip(f"no shipped DFlash draft for {SMOL} yet ({SHIPPED_SMOL} does not exist)")
    monkeypatch.delenv(DRAFTS_ENV, raising=False)
    assert shipped_draft_dir(SMOL) == SHIPPED_SMOL
    from flashfleet.cli.up import worker_env

    model_dir = fetched(SMOL)
    env = {**worker_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, str(model_dir), str(SHIPPED_SMOL)], env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 2
    for r in results:
        assert len(r["ref"]) == 24, r
        if r["out"] == r["ref"]:
            continue
        # On a GPU only, a divergence at a near tie of the target's logits is tolerated.
        assert "at" in r, f"{r['text']!r}: lengths differ: {len(r['out'])} vs {len(r['ref'])}"
        assert r["gpu"] and r["near_tie"], (
            f"DFlash greedy differs from plain at token {r['at']} of {r['text']!r}: "
            f"{r['out'][r['at']]} vs {r['ref'][r['at']]} (logit gap {r['gap']:.4g})")


if __name__ == "__main__":  # the child process of the real-model test: MODEL_DIR DRAFT_DIR
    print(json.dumps(greedy_pairs(sys.argv[1], sys.argv[2])))


def test_dflash_keyword_with_a_misspelt_model_says_unknown_model():
    from flashfleet.models.drafts import NoShippedDraftError, resolve_draft_arg

    with pytest.raises(NoShippedDraftError, match="unknown model 'SmolLM2-135M-Instrct' \\(did you mean 'SmolLM2-135M-Instruct'\\?\\)"):
        resolve_draft_arg("dflash", "SmolLM2-135M-Instrct")


def test_up_rejects_unknown_model_or_draft_before_starting_anything(capsys, tmp_path):
    from flashfleet.cli.up import main, served_name

    assert main(["--model", "SmolLM2-135M-Instrct", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model 'SmolLM2-135M-Instrct' is neither" in err[0] and "did you mean" in err[0]
    assert main(["--model", "SmolLM2-135M-Instruct", "--draft", str(tmp_path / "nope"), "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flashfleet up: --draft ")
    assert served_name(str(tmp_path)) == tmp_path.name and served_name("SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    # another capitalisation is served under the catalog spelling, the name clients default to
    assert served_name("smollm2-135m-INSTRUCT") == "SmolLM2-135M-Instruct"
    assert served_name("not-a-model") == "not-a-model"
    for flag in ("--workers", "--capacity"):  # 0 is an error, not "the default"
        with pytest.raises(SystemExit) as e:
            main([flag, "0", "--port", "1"])
        assert e.value.code == 2 and f"{flag} must be >= 1, got 0" in capsys.readouterr().err
