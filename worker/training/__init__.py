"""Training DFlash drafts (Chen et al. 2026, arXiv 2602.06036, §4.2; SpecForge's recipe).

Modules, one job each:
    data      prompts, held-out split, target-written responses (batched), on-disk cache, batches
    masks     anchors and the anchor/block attention masks
    forward   the draft's training forward over many anchored blocks at once
    loss      labels, position-decayed cross-entropy, teacher-forced acceptance
    defaults  the draft's shape chosen from the target (depth, taps, mask id, size budget)
    train     the compiled training loop, checkpoints, the whole job (`train_draft`)
    evaluate  acceptance length tau on held-out prompts with the real decode loop
    card      TRAINING.md from the training card

Typical use::

    from worker.training import TrainConfig, train_draft
    card = train_draft(TrainConfig(target="SmolLM2-135M-Instruct", prompts=["code.jsonl"], out="drafts/x"))

(`flashfleet draft train` is the command-line front end.) Import this package lazily: it loads MLX.
"""
from worker.training.defaults import DraftSpec, choose_draft_spec
from worker.training.evaluate import evaluate_tau
from worker.training.train import TrainConfig, Trainer, train_draft

__all__ = ["DraftSpec", "TrainConfig", "Trainer", "choose_draft_spec", "evaluate_tau", "train_draft"]
