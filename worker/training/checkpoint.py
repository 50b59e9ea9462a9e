"""The resumable training state: float32 draft weights, AdamW moments, the draft vocabulary, and the
run's counters as JSON (`Trainer.save_state` / `Trainer.load_state` call these)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from worker.models.dflash import Model, ModelArgs
from worker.training.config import TrainConfigError

STATE_FORMAT = 1


def args_dict(args: ModelArgs) -> dict:
    """The draft's shape as JSON-ready values (what a checkpoint must match), rope parameters left out."""
    d = asdict(args)
    d.pop("rope_parameters", None)
    return json.loads(json.dumps(d))


def save_state(path: Path, draft: Model, opt: optim.Optimizer, meta: dict) -> None:
    """Writes the draft's weights, `opt`'s state and the draft vocabulary (state.safetensors) and
    `meta` with the format and the draft's shape added (state.json) to `path`/ (created).

    Files are written under temporary names and renamed, the JSON last, so an interrupted save
    leaves the previous checkpoint readable."""
    path.mkdir(parents=True, exist_ok=True)
    arrays = {f"param/{k}": v for k, v in tree_flatten(draft.parameters())}
    arrays.update({f"opt/{k}": v for k, v in tree_flatten(opt.state)})
    if draft.vocab is not None:
        arrays["vocab"] = draft.vocab
    mx.save_safetensors(str(path / "state.tmp.safetensors"), arrays)
    os.replace(path / "state.tmp.safetensors", path / "state.safetensors")
    meta = {"format": STATE_FORMAT, **meta, "draft_args": args_dict(draft.args)}
    (path / "state.tmp.json").write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(path / "state.tmp.json", path / "state.json")


def load_state(path: Path, draft: Model, opt: optim.Optimizer) -> dict:
    """Restores what `save_state` wrote into `draft` (weights and vocabulary) and `opt`, evaluated.

    Returns:
        The JSON metadata.

    Raises:
        TrainConfigError: the checkpoint's draft shape differs from `draft`'s.
    """
    meta = json.loads((path / "state.json").read_text())
    arrays = mx.load(str(path / "state.safetensors"))
    draft.set_vocab(None if "vocab" not in arrays else np.array(arrays["vocab"]))  # the checkpoint's
    if meta.get("draft_args") != args_dict(draft.args):
        raise TrainConfigError(f"{path}: checkpoint is for another draft shape; start over with --no-resume")
    draft.load_weights([(k[6:], v) for k, v in arrays.items() if k.startswith("param/")], strict=True)
    opt.state = tree_unflatten([(k[4:], v) for k, v in arrays.items() if k.startswith("opt/")])
    opt.init(draft.trainable_parameters())
    mx.eval(draft.parameters(), opt.state)
    return meta
