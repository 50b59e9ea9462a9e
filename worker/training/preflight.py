"""Checks of a run's inputs and of the draft's starting shape, before the target answers a prompt.

`preflight` (also run once by the launcher of `flashfleet draft train --processes N`) needs no
weights; `init_checkpoint`, `check_resumed_shape` and `check_grown_size` check an --init-from draft
or a resumed checkpoint against the shape options inside `train.train_draft`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from worker.models.dflash_checkpoint import (DraftCheckpointError, DraftMismatch, dequantized_weights,
                                             load_dflash_draft, read_draft_config)
from worker.training.config import TrainConfig, TrainConfigError
from worker.training.data import DataError, read_prompt_files
from worker.training.defaults import DraftSpec
from worker.training.extra_data import check_extra_data
from worker.training.synthetic import check_synthetic_inputs
from worker.training.target import resolve_target, target_config, target_fingerprint


def init_checkpoint(cfg: TrainConfig, target) -> tuple[DraftSpec, DraftSpec, dict, Optional[mx.array]]:
    """Shapes and float32 weights of the draft in `cfg.init_from` (dequantized if it is 4/8-bit).

    Returns:
        (the saved draft's shape, the shape to train: the saved one grown to an explicit larger
        --draft-layers / --intermediate-size (`grow.grow_weights`), its weights, its draft
        vocabulary or None).

    Raises:
        TrainConfigError: the directory is not a draft for this target, or an explicit shape
            option (--target-layer-ids, --mask-token-id, or a --draft-layers /
            --intermediate-size below the draft's) disagrees with it. The block size is the
            checkpoint's too.
    """
    try:
        init = load_dflash_draft(cfg.init_from, target)
    except (DraftCheckpointError, DraftMismatch) as e:
        raise TrainConfigError(f"--init-from: {e}") from e
    a = init.args
    saved = DraftSpec(a.num_hidden_layers, a.block_size, list(a.dflash_config["target_layer_ids"]),
                      int(a.dflash_config["mask_token_id"]), a.intermediate_size)
    return saved, grown_init_shape(cfg, saved), dequantized_weights(init), init.vocab


def _clashes(asked: dict, bad: Callable[[object, object], bool], has: str, note: str = "") -> list[str]:
    """'FLAG WANT (HAS HAVE[NOTE])' for each {flag: (want, have)} asked explicitly (want not None)
    with bad(want, have); `has` names the owner, e.g. "the draft has"."""
    return [f"{flag} {want} ({has} {have}{note})" for flag, (want, have) in asked.items()
            if want is not None and bad(want, have)]


def grown_init_shape(cfg: TrainConfig, saved: DraftSpec) -> DraftSpec:
    """The shape to train from an --init-from draft of shape `saved`: its own, with an explicit
    larger --draft-layers / --intermediate-size grown into.

    Raises:
        TrainConfigError: an explicit option that disagrees with the draft (taps, mask token) or
            would shrink it (fewer layers, a narrower MLP).
    """
    clash = _clashes({"--target-layer-ids": (cfg.target_layer_ids, saved.target_layer_ids),
                      "--mask-token-id": (cfg.mask_token_id, saved.mask_token_id)},
                     lambda want, have: want != have, "the draft has")
    clash += _clashes({"--draft-layers": (cfg.draft_layers, saved.num_layers),
                       "--intermediate-size": (cfg.intermediate_size, saved.intermediate_size)},
                      lambda want, have: want < have, "the draft has", "; it can grow, not shrink")
    if clash:
        raise TrainConfigError(f"--init-from {cfg.init_from} fixes the draft's shape; drop or change " + ", ".join(clash))
    return DraftSpec(cfg.draft_layers or saved.num_layers, saved.block_size, saved.target_layer_ids,
                     saved.mask_token_id, cfg.intermediate_size or saved.intermediate_size)


def check_resumed_shape(cfg: TrainConfig, spec: DraftSpec, state_dir: Path, vocab_size: Optional[int]) -> None:
    """Raises TrainConfigError when an explicit --draft-layers / --intermediate-size / --draft-vocab
    (`vocab_size`: the checkpoint's draft vocabulary, None for the whole head) differs from
    the shape of the checkpoint being resumed (e.g. a new growth asked in an old work dir), which
    would otherwise train the old shape without a word."""
    clash = _clashes({"--draft-layers": (cfg.draft_layers, spec.num_layers),
                      "--intermediate-size": (cfg.intermediate_size, spec.intermediate_size)},
                     lambda want, have: want != have, "the checkpoint has")
    clash += _clashes({"--draft-vocab": (cfg.draft_vocab, vocab_size or 0)},
                      lambda want, have: want != have, "the checkpoint has")
    if clash:
        raise TrainConfigError(f"{state_dir}: resuming a checkpoint of another shape: " + ", ".join(clash)
                               + "; rerun with --no-resume (or another --work-dir) to start this shape")


def check_grown_size(cfg: TrainConfig, spec: DraftSpec, target, bytes_per_param: float) -> None:
    """Raises TrainConfigError when a draft grown from --init-from would exceed --max-draft-mib
    (a fresh draft is shrunk to fit instead; a grown one has the size the options ask for)."""
    mib = spec.num_params(target) * bytes_per_param / 2**20
    if cfg.max_draft_mib is not None and mib > cfg.max_draft_mib:
        raise TrainConfigError(f"--init-from {cfg.init_from} grown to {spec.num_layers} layer(s), MLP "
                               f"{spec.intermediate_size} is {mib:.1f} MiB, over --max-draft-mib {cfg.max_draft_mib:g}: "
                               "raise the budget or ask for less")


def check_init_against_target(cfg: TrainConfig, draft_config: dict, target_path: Path) -> None:
    """An --init-from draft made for another target (hidden size, a tap past its last layer, a
    mask id outside its vocabulary) fails before the target answers any prompt, as `draft eval`
    does, instead of after data generation."""
    t = target_config(target_path)
    hidden, layers, vocab = (t.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    d = draft_config["dflash_config"]
    if hidden is not None and int(draft_config["hidden_size"]) != hidden:
        raise TrainConfigError(f"--init-from {cfg.init_from}: draft hidden_size {draft_config['hidden_size']} "
                               f"!= target hidden size {hidden}: that draft belongs to another target")
    bad = [i for i in d["target_layer_ids"] if layers is not None and not 0 <= int(i) < layers]
    if bad:
        raise TrainConfigError(f"--init-from {cfg.init_from}: taps {bad} are past the target's {layers} layers")
    if vocab is not None and not 0 <= int(d["mask_token_id"]) < vocab:
        raise TrainConfigError(f"--init-from {cfg.init_from}: mask_token_id {d['mask_token_id']} is outside "
                               f"the target's vocabulary ({vocab} rows)")


def check_taps_and_mask(cfg: TrainConfig, target_path: Path) -> None:
    """Explicit --target-layer-ids and --mask-token-id against the target's config.json, before
    any weights load or the target answers a prompt (otherwise a tap past the last layer would
    fail only when the draft is built, after data generation)."""
    if not (cfg.target_layer_ids or cfg.mask_token_id is not None):
        return
    layers, vocab = (target_config(target_path).get(k) for k in ("num_hidden_layers", "vocab_size"))
    bad = [i for i in cfg.target_layer_ids or () if layers is not None and not 0 <= i < layers]
    if bad:
        raise TrainConfigError(f"--target-layer-ids {bad} out of range: the target has {layers} layers "
                               f"(0..{layers - 1})")
    if cfg.target_layer_ids and len(set(cfg.target_layer_ids)) != len(cfg.target_layer_ids):
        raise TrainConfigError(f"--target-layer-ids {cfg.target_layer_ids} repeats a layer")
    if cfg.mask_token_id is not None and vocab is not None and not 0 <= cfg.mask_token_id < vocab:
        raise TrainConfigError(f"--mask-token-id {cfg.mask_token_id} out of range: the target's vocabulary "
                               f"has {vocab} rows")


def preflight(cfg: TrainConfig) -> None:
    """The input checks of `train_draft` that need no model weights, for the launcher of
    `flashfleet draft train --processes N`: run there once, a bad input is one message and exit 2
    instead of one traceback-free message per rank after every rank has loaded the target.

    Checks: the target resolves to a model directory; every prompt file exists and parses;
    explicit taps and mask id fit the target's config.json; --out holds no draft unless this run
    continues its checkpoint or `overwrite` is set;
    `--synthetic-prompts` inputs (`synthetic.check_synthetic_inputs`, reading only the tokenizer);
    `--extra-data` directories (complete caches of this target: `extra_data.check_extra_data`);
    an --init-from directory is a DFlash draft made for this target (hidden size, taps, mask id
    against its config.json) whose shape agrees with explicit shape options.
    Checkpoint compatibility is still checked by the ranks (it needs the data key).

    Raises:
        FileNotFoundError / NotADirectoryError: target or a prompt file missing.
        DataError: a prompt file that does not parse, or unusable synthetic-prompt inputs.
        TrainConfigError: an --init-from directory that is no draft, or whose shape clashes.
    """
    path = resolve_target(cfg.target)
    read_prompt_files(cfg.prompts, cfg.max_prompts_per_file)
    check_taps_and_mask(cfg, path)
    out = Path(cfg.out)
    work = Path(cfg.work_dir) if cfg.work_dir else out.with_name(out.name + ".work")
    # A plain rerun that finds a finished draft and no checkpoint to continue would quietly train
    # a new one over it; --no-resume (start over) and --overwrite say that is meant.
    if (out / "config.json").is_file() and cfg.resume and not cfg.overwrite \
            and not (work / "resume" / "state.json").is_file():
        raise TrainConfigError(f"--out {out} already holds a draft and there is no checkpoint of it to "
                               f"continue in {work}/resume: pass --overwrite (or --no-resume) to replace "
                               "it, or another --out")
    if (cfg.synthetic_openings or cfg.synthetic_openings_from) and not cfg.synthetic_prompts:
        raise DataError("--synthetic-openings / --synthetic-openings-from shape the prompts the target writes: "
                        "give --synthetic-prompts N too")
    if cfg.synthetic_prompts:
        from mlx_lm.utils import load_tokenizer

        try:
            tokenizer = load_tokenizer(path)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None
        check_synthetic_inputs([Path(p) for p in cfg.prompts], cfg.synthetic_temperature, tokenizer,
                               (cfg.synthetic_openings, tuple(cfg.synthetic_openings_from)))
    if cfg.extra_data:
        check_extra_data(cfg.extra_data, target_fingerprint(path), read_rows=True)
    if cfg.init_from:
        try:
            c = read_draft_config(Path(cfg.init_from).expanduser())
            d = c["dflash_config"]
            spec = DraftSpec(int(c["num_hidden_layers"]), int(c.get("block_size", cfg.block_size)),
                             list(d["target_layer_ids"]), int(d["mask_token_id"]), int(c["intermediate_size"]))
            int(c["hidden_size"])
        except DraftCheckpointError as e:
            raise TrainConfigError(f"--init-from: {e}") from e
        except (KeyError, TypeError, ValueError) as e:
            raise TrainConfigError(f"--init-from {cfg.init_from}: not a DFlash draft config ({e!r} missing or bad)") from e
        check_init_against_target(cfg, c, path)
        grown_init_shape(cfg, spec)


