"""Training DFlash drafts (Chen et al. 2026, arXiv 2602.06036, §4.2; SpecForge's recipe).

Modules, one job each:
    data        prompt files, held-out split, answer orders, chat-templated prompts
    sequences   tokenised training sequences and their padded, length-classed batches
    answers     the target's answers to the training prompts (`build_dataset`), batched
    data_cache  the data cache: its key, what it holds
    synthetic   prompts the target writes itself (Magpie), with openings
    extra_data  earlier runs' data caches reused (`--extra-data`)
    generation  batched generation of answers by the target
    masks       anchors and the anchor/block attention masks
    forward     the draft's training forward over many anchored blocks at once
    loss        labels, position-decayed cross-entropy, teacher-forced acceptance
    defaults    the draft's shape chosen from the target (depth, taps, mask id, size, vocabulary)
    grow        a saved draft grown to more layers or a wider MLP
    config      a run's settings (`TrainConfig`)
    target      the target found, loaded and fingerprinted
    preflight   input and shape checks before any generation
    step        the learning-rate schedule and the compiled training step
    taps_cache  the target's taps kept in memory per length class ("offline")
    trainer     the training loop (`Trainer`)
    run_log     loss-curve points and the progress bar of a run
    validation  teacher-forced validation on held-out answers
    checkpoint  the resumable training state
    interrupt   Ctrl-C at a step boundary
    distributed data-parallel processes (`mlx.launch`)
    train       the whole job (`train_draft`)
    evaluate    acceptance length tau on held-out prompts with the real decode loop
    card        TRAINING.md from the training card

Typical use::

    from worker.training import TrainConfig, train_draft
    card = train_draft(TrainConfig(target="SmolLM2-135M-Instruct", prompts=["code.jsonl"], out="drafts/x"))

(`flashfleet draft train` is the command-line front end.) Import this package lazily: it loads MLX.
"""
from worker.training.config import TrainConfig
from worker.training.defaults import DraftSpec, choose_draft_spec
from worker.training.evaluate import evaluate_tau
from worker.training.train import train_draft
from worker.training.trainer import Trainer

__all__ = ["DraftSpec", "TrainConfig", "Trainer", "choose_draft_spec", "evaluate_tau", "train_draft"]
