"""Train a DFlash draft for a target, the whole job (`train_draft`, behind `flashfleet draft train`).

Steps: check the inputs (`preflight`), load the target (`target`), answer the prompts
(`answers.build_dataset`, cached), choose or load the draft (`defaults`, `preflight.init_checkpoint`,
`grow`), train it (`trainer.Trainer`), save it, measure tau on the held-out prompts
(`evaluate.evaluate_tau`) and write the training card (`card`).

Files: the draft in the published layout (`save_dflash_draft`: config.json + model.safetensors,
in `save_dtype`), `training_card.json` and `TRAINING.md` go to `out`; the data cache and the
resumable training state (float32 weights + AdamW moments, `checkpoint`) go to `work_dir`.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from worker.capture import target_hidden_size, target_layers, target_vocab_size
from worker.models.dflash_checkpoint import (load_dflash_draft, quantize_dflash_draft, quantized_bytes_per_param,
                                             save_dflash_draft)
from worker.training.answers import build_dataset
from worker.training.card import render_card, tau_line
from worker.training.config import DTYPES, TrainConfig, TrainConfigError, resolve_dtype
from worker.training.data_cache import DataSplit, dataset_key
from worker.training.defaults import DraftSpec, choose_draft_spec, make_draft, set_draft_vocab, used_token_ids
from worker.training.distributed import agree_sum, broadcast_tree, leave_gpu_headroom, rank_of, size_of, world
from worker.training.evaluate import evaluate_tau
from worker.training.extra_data import check_extra_data, extra_data_key
from worker.training.forward import cast_tree
from worker.training.grow import grow_weights
from worker.training.preflight import check_grown_size, check_resumed_shape, init_checkpoint
from worker.training.synthetic import SYNTHETIC_CORPUS
from worker.training.taps_cache import tap_cache_plan
from worker.training.target import load_target, resolve_target, target_fingerprint
from worker.training.trainer import Trainer
from worker.training.validation import lowest_hashes, split_validation


def _file_mib(path: Path) -> float:
    return round(path.stat().st_size / 2**20, 2)

def _token_sequences(split: DataSplit) -> list:
    """The token id lists of the training prompts and answers and of the held-out prompts."""
    return [*split.train.prompt_ids, *split.train.response_ids, *(h["prompt_ids"] for h in split.heldout)]


def _thinned(points: list, n: int) -> list:
    """About `n` evenly spaced points of a curve, the last one always included once."""
    out = points[:: max(1, len(points) // n)]
    return out + points[-1:] if points and out[-1] is not points[-1] else out


def _data_totals(split: DataSplit, prompt_files: Sequence[str], group) -> dict:
    """The data's meta over all ranks: counts and generation rate summed, generation time the
    ranks' mean, corpora counted per prompt file and for the synthetic prompts (called on every
    rank alike)."""
    meta = dict(split.meta)
    if group is None:
        return meta
    stems = sorted({Path(p).stem for p in prompt_files} | {SYNTHETIC_CORPUS} | set(meta.get("extra_corpora", [])))
    counts = ("train_sequences", "train_tokens", "response_tokens", "ended_with_eos", "synthetic_prompts_written",
              "extra_greedy_reused", "extra_added")
    cut = int(bool(meta.get("generation_stopped_by_time_limit")))
    summed = agree_sum([meta.get(k, 0) for k in counts] + [cut] + [meta["corpora"].get(c, 0) for c in stems],
                       group, dtype=mx.int32)
    meta.update(zip(counts, summed))
    meta["generation_stopped_by_time_limit"] = summed[len(counts)] > 0
    meta["corpora"] = {c: v for c, v in zip(stems, summed[len(counts) + 1:]) if v}
    rate, secs = agree_sum([meta.get("generation_tokens_per_s", 0.0), meta.get("generation_s", 0.0)], group)
    meta["generation_tokens_per_s"] = round(rate, 1)  # all ranks together
    meta["generation_s"] = round(secs / group.size(), 1)  # the ranks' mean
    return meta


def train_draft(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict:
    """Builds the data, trains the draft, saves it, measures tau, writes the training card.

    Args:
        cfg: the run's settings (`TrainConfig`).
        log: one-line progress messages (tqdm bars are separate, on stderr).

    Under `mlx.launch` with several processes (`distributed.world()`), every rank runs this:
    rank r answers its share of the prompts into `work/data-rank{r}of{W}`, training is data
    parallel (`Trainer`), and rank 0 alone saves the draft, evaluates it and writes the card
    (data counts summed over ranks); the other ranks return `{"rank": r}` after training.
    Resuming needs `work_dir` on a file system every rank sees.

    Returns:
        The training card (also written to `out/training_card.json`).

    Raises:
        FileNotFoundError / NotADirectoryError: target or prompt files missing.
        DataError: unusable prompt files or data.
        DraftSizeError: no draft shape fits --max-draft-mib.
        TrainConfigError: a checkpoint of another draft shape or other data.
        DraftMismatch: explicit taps or mask id that do not fit the target.
    """
    t_start = time.perf_counter()
    group = world()
    rank, n_ranks = rank_of(group), size_of(group)
    if rank:  # one voice: rank 0 logs and shows progress
        log, cfg = (lambda _msg: None), replace(cfg, progress=False)
    if (limit := leave_gpu_headroom(group)) is not None:
        log(f"memory: MLX limit {limit / 2**30:.1f} GiB per GPU (headroom for NCCL)")
    target_path = resolve_target(cfg.target)
    out = Path(cfg.out)
    work = Path(cfg.work_dir) if cfg.work_dir else out.with_name(out.name + ".work")
    tdt = resolve_dtype(cfg.target_dtype)
    log(f"target: {target_path} ({tdt}); device {mx.default_device()}; out {out}; work {work}"
        + (f"; data parallel over {n_ranks} processes" if group is not None else ""))
    fingerprint = target_fingerprint(target_path)
    if cfg.extra_data:  # before loading the target: another target's data is known now
        check_extra_data(cfg.extra_data, fingerprint)
    target, tokenizer = load_target(target_path, tdt)

    data_kw = dict(max_per_file=cfg.max_prompts_per_file, max_prompt_tokens=cfg.max_prompt_tokens,
                   max_new_tokens=cfg.max_new_tokens, heldout_per_corpus=cfg.heldout_per_corpus,
                   heldout_fraction=cfg.heldout_fraction, temperature=cfg.gen_temperature, top_p=cfg.gen_top_p,
                   seed=cfg.seed, samples=cfg.gen_samples, sample_temperature=cfg.gen_sample_temperature,
                   synthetic=cfg.synthetic_prompts, synthetic_max_tokens=cfg.synthetic_max_tokens,
                   synthetic_temperature=cfg.synthetic_temperature,
                   synthetic_openings=(cfg.synthetic_openings, tuple(cfg.synthetic_openings_from)),
                   target_fingerprint=fingerprint)
    state_dir = work / "resume"
    resuming = cfg.resume and (state_dir / "state.json").is_file()
    seen_by = agree_sum([resuming], group)[0]
    if 0 < seen_by < n_ranks:
        raise TrainConfigError(f"{state_dir}: only {seen_by:.0f} of {n_ranks} processes see the checkpoint; "
                               "give every rank the same --work-dir (a shared file system) or use --no-resume")
    if resuming:  # before generating: a mismatch is known now
        saved = json.loads((state_dir / "state.json").read_text())
        extra = extra_data_key(cfg.extra_data) if cfg.extra_data else None
        if saved.get("data_key") != dataset_key(cfg.prompts, **data_kw, extra=extra)[0]:
            raise TrainConfigError(f"{state_dir}: the checkpoint was trained on other data (prompt files or data "
                                   "options changed); rerun with --no-resume to start over on the new data")
        if saved.get("val_fraction", 0.0) != cfg.val_fraction:  # it decides which sequences train
            raise TrainConfigError(f"{state_dir}: the checkpoint was trained with --val-fraction "
                                   f"{saved.get('val_fraction', 0.0)} (this run: {cfg.val_fraction}), which "
                                   "holds other sequences out of training: rerun with that value, or --no-resume")
        if saved.get("world_size", 1) != n_ranks:
            raise TrainConfigError(f"{state_dir}: the checkpoint was trained by {saved.get('world_size', 1)} "
                                   f"process(es), this run has {n_ranks}; each rank's data shard would change: "
                                   "rerun with as many processes, or --no-resume")
    data_dir = work / "data" if group is None else work / f"data-rank{rank}of{n_ranks}"
    split = build_dataset(target, tokenizer, cfg.prompts, data_dir, gen_batch_size=cfg.gen_batch_size,
                          gen_max_seconds=cfg.gen_max_minutes * 60 if cfg.gen_max_minutes else None,
                          regenerate=cfg.regenerate_data, shard=(rank, n_ranks), progress=cfg.progress,
                          extra_data=cfg.extra_data, log=log, **data_kw)
    data_meta = _data_totals(split, cfg.prompts, group)
    if group is not None:
        log(f"data: {data_meta['train_sequences']} sequences, {data_meta['response_tokens']} response tokens "
            f"over {n_ranks} processes (each trains on its own)")

    resumed, init_weights, saved_spec, grown_from, init_vocab = None, None, None, None, None
    if cfg.quantize_bits:
        bytes_per_param = quantized_bytes_per_param(cfg.quantize_bits, cfg.quantize_group_size,
                                                    DTYPES[cfg.save_dtype].size)
        stored = f"{cfg.quantize_bits}-bit (groups of {cfg.quantize_group_size}, {cfg.save_dtype} scales)"
    else:
        bytes_per_param, stored = DTYPES[cfg.save_dtype].size, cfg.save_dtype
    if resuming:
        saved = json.loads((state_dir / "state.json").read_text())  # its data key was checked above
        args = saved["draft_args"]
        dc = args["dflash_config"]
        spec = DraftSpec(args["num_hidden_layers"], args["block_size"], dc["target_layer_ids"], dc["mask_token_id"],
                         args["intermediate_size"])
        check_resumed_shape(cfg, spec, state_dir, args.get("draft_vocab_size"))
        grown_from = saved.get("grown_from")
    elif cfg.init_from:
        saved_spec, spec, init_weights, init_vocab = init_checkpoint(cfg, target)
        if spec != saved_spec:
            check_grown_size(cfg, spec, target, bytes_per_param)
            grown_from = {"layers": saved_spec.num_layers, "intermediate_size": saved_spec.intermediate_size}
    else:
        spec = choose_draft_spec(
            target, tokenizer, used_token_ids(_token_sequences(split), target_vocab_size(target), group),
            draft_layers=cfg.draft_layers, num_taps=cfg.num_taps,
            target_layer_ids=cfg.target_layer_ids, mask_token_id=cfg.mask_token_id, block_size=cfg.block_size,
            intermediate_size=cfg.intermediate_size, max_draft_mib=cfg.max_draft_mib,
            bytes_per_param=bytes_per_param)
    from_target = cfg.init_layers == "target" and init_weights is None and not resuming
    draft = make_draft(target, spec, cfg.seed, from_target=from_target)
    if from_target:
        log(f"init: draft layers start from the target's last {spec.num_layers} (--init-layers target)")
    if init_weights is not None:
        if grown_from:
            init_weights = grow_weights(init_weights, dict(tree_flatten(draft.parameters())))
        draft.load_weights(list(init_weights.items()), strict=True)
        mx.eval(draft.parameters())
        log(f"init: weights from {cfg.init_from}" + (
            f", grown from {saved_spec.num_layers} layer(s), MLP {saved_spec.intermediate_size} to "
            f"{spec.num_layers}, MLP {spec.intermediate_size} (the same function at step 0)" if grown_from else ""))
    draft.update(broadcast_tree(draft.parameters(), group))
    vocab_meta = None
    if not resuming:  # a resumed run takes the checkpoint's (`load_state`)
        vocab_meta = set_draft_vocab(draft, cfg.draft_vocab, init_vocab, split.train.response_ids,
                                     getattr(tokenizer, "eos_token_ids", ()) or (), group, log)
    n_params = spec.num_params(target)
    log(f"draft: {spec.num_layers} layer(s), taps {spec.target_layer_ids}, mask id {spec.mask_token_id}, "
        f"B={spec.block_size}, MLP {spec.intermediate_size}, {n_params / 1e6:.2f} M parameters "
        f"({n_params * bytes_per_param / 2**20:.1f} MiB saved as {stored})")

    train_data, val_data = split_validation(split.train, cfg.val_fraction)
    trainer = Trainer(target, draft, train_data, cfg, group)
    trainer.set_validation(lowest_hashes(val_data, -(-cfg.val_max_sequences // n_ranks)))  # per rank
    if resuming:
        resumed = trainer.load_state(state_dir)
        log(f"resume: step {trainer.step}, {trainer.elapsed_s:.0f} s trained, from {state_dir}")
        before = saved.get("val_max_sequences", cfg.val_max_sequences)
        if before != cfg.val_max_sequences:  # training is unchanged; the curve's rows are not
            log(f"val: --val-max-sequences {cfg.val_max_sequences} (the checkpoint's run measured {before}): the "
                f"validation points from step {trainer.step} on are measured on other rows than the earlier ones")
    elif rank == 0 and state_dir.exists():  # rank 0 alone writes (and clears) the checkpoint
        for f in state_dir.glob("state*"):
            f.unlink(missing_ok=True)
    if cfg.cache_taps_gib:
        classes, message = tap_cache_plan(trainer, cfg.cache_taps_gib)
        log(message)
        if classes:
            trainer.precompute_taps(cfg.progress, classes, log)
    log(f"train: {trainer.n} sequences (S={trainer.tokens.shape[1]}, batch widths {trainer.widths}), "
        f"batch {trainer.bsz}" + (f" per rank x {n_ranks} ranks" if group is not None else "") + f", {trainer.N} anchors, "
        f"gamma {trainer.gamma}, up to {trainer.total_steps} steps"
        + (f" or {cfg.max_minutes} min" if cfg.max_minutes else "") + f", compute {trainer.cdt}")
    n_val, n_measured = agree_sum([len(val_data), len(trainer.validator)], group)
    log(f"val: {n_val:.0f} sequences held out of this run's training, {n_measured:.0f} measured (teacher-forced)"
        + (f" every {cfg.val_every} steps" if cfg.val_every else " at the end") if n_val else
        "val: no validation sequences (--val-fraction 0, or too little data)")
    save = lambda: trainer.save_state(state_dir, {"data_key": split.meta["key"], "world_size": n_ranks,  # noqa: E731
                                                  "val_fraction": cfg.val_fraction,
                                                  "val_max_sequences": cfg.val_max_sequences,
                                                  "grown_from": grown_from})
    if trainer.step == 0 and cfg.val_every:
        # Where the starting weights stand (an --init-from draft may know validation rows from
        # earlier runs): without this point a curve cannot tell forgetting from learning.
        trainer.validate(log=log)  # every rank, like the later points
    result = trainer.run(checkpoint=save if rank == 0 else None, log=log)
    if not trainer.val_history or trainer.val_history[-1]["step"] != trainer.step:
        trainer.validate(log=log)  # every rank: the result is summed over them
        if rank == 0:
            save()  # the checkpoint holds the final point too
    label_rate = agree_sum([result.get("label_tokens_per_s", 0.0)], group)[0]  # all processes together
    if rank:
        return {"rank": rank, "steps": result["steps"]}

    sdt = DTYPES[cfg.save_dtype]
    draft.update(cast_tree(draft.parameters(), sdt))
    full_dir = work / "unquantized"
    if cfg.quantize_bits:  # keep the unquantized draft beside the data, evaluate both
        save_dflash_draft(draft, full_dir)
        quantize_dflash_draft(draft, cfg.quantize_bits, cfg.quantize_group_size)
    save_dflash_draft(draft, out)
    log(f"saved: {out} ({_file_mib(out / 'model.safetensors')} MiB)")

    evals = {}
    if cfg.eval and not split.heldout:
        log("eval: no held-out prompts (--heldout-per-corpus 0, or corpora of one prompt): tau not measured")
    if cfg.eval and split.heldout:
        eos = tokenizer.eos_token_ids
        eval_s = cfg.eval_max_minutes * 60 if cfg.eval_max_minutes else None
        edt = resolve_dtype(cfg.compute_dtype)
        trained = load_dflash_draft(out, target, dtype=None if cfg.quantize_bits else edt)
        evals["trained"] = evaluate_tau(target, trained, split.heldout, cfg.eval_max_new_tokens, eos,
                                        max_seconds=eval_s, progress=cfg.progress, desc="tau trained")
        log("tau (trained): " + tau_line(evals["trained"]))
        if cfg.quantize_bits and cfg.eval_unquantized:
            full = load_dflash_draft(full_dir, target, dtype=edt)
            evals["unquantized"] = evaluate_tau(target, full, split.heldout, cfg.eval_max_new_tokens, eos,
                                                max_seconds=eval_s, progress=cfg.progress, desc="tau unquantized")
            log("tau (unquantized): " + tau_line(evals["unquantized"]))
        if cfg.eval_untrained:
            untrained = make_draft(target, spec, cfg.seed, from_target=cfg.init_layers == "target")
            untrained.update(cast_tree(untrained.parameters(), resolve_dtype(cfg.compute_dtype)))
            evals["untrained"] = evaluate_tau(target, untrained, split.heldout, cfg.eval_max_new_tokens, eos,
                                              max_seconds=eval_s, progress=cfg.progress, desc="tau untrained")
            log("tau (untrained): " + tau_line(evals["untrained"]))

    card = {
        "format": "flashfleet-dflash-training-card/1",
        "method": "DFlash (arXiv 2602.06036) block-diffusion draft; recipe of paper §4.2 / SpecForge OnlineDFlashModel",
        "target": {"path": str(target_path), "name": target_path.name, "fingerprint": fingerprint,
                   "layers": len(target_layers(target)), "hidden_size": target_hidden_size(target),
                   "vocab_size": target_vocab_size(target), "dtype": str(tdt)},
        "draft": {"layers": spec.num_layers, "target_layer_ids": spec.target_layer_ids,
                  "mask_token_id": spec.mask_token_id, "block_size": spec.block_size,
                  "intermediate_size": spec.intermediate_size, "parameters": n_params,
                  "dtype": cfg.save_dtype, "quantization": draft.args.quantization,
                  "draft_vocab": vocab_meta if vocab_meta or draft.vocab is None else {"size": int(draft.vocab.size)},
                  "file_mib": _file_mib(out / "model.safetensors")},
        "data": {k: data_meta.get(k) for k in ("train_sequences", "heldout_prompts", "train_tokens", "response_tokens",
                                                "ended_with_eos", "generation_s", "generation_tokens_per_s",
                                                "generation_stopped_by_time_limit", "corpora", "key",
                                                "synthetic_prompts_written", "extra_greedy_reused", "extra_added",
                                                "extra_data")}
        | {"files": [Path(p).name for p in cfg.prompts], "max_prompts_per_file": cfg.max_prompts_per_file,
           "max_prompt_tokens": cfg.max_prompt_tokens, "max_new_tokens": cfg.max_new_tokens,
           "gen_temperature": cfg.gen_temperature, "gen_samples": cfg.gen_samples,
           "gen_sample_temperature": cfg.gen_sample_temperature, "synthetic_prompts": cfg.synthetic_prompts,
           "synthetic_max_tokens": cfg.synthetic_max_tokens, "synthetic_temperature": cfg.synthetic_temperature,
           "synthetic_openings": cfg.synthetic_openings, "synthetic_openings_from": list(cfg.synthetic_openings_from),
           "seed": cfg.seed,
           "heldout_per_corpus": {c: sum(1 for h in split.heldout if h["corpus"] == c)
                                  for c in sorted({h["corpus"] for h in split.heldout})}},
        "training": {"steps": result["steps"],
                     # as the progress bar and the curve count them: batches of (rank 0's) data
                     "epochs": round(result["steps"] / trainer.per_epoch, 2),
                     "elapsed_s": result["elapsed_s"], "batch_size": trainer.bsz, "processes": n_ranks,
                     "anchors": trainer.N,
                     "seq_len": int(trainer.tokens.shape[1]), "gamma": trainer.gamma, "lr": cfg.lr,
                     "warmup": cfg.warmup, "min_lr_ratio": cfg.min_lr_ratio, "weight_decay": cfg.weight_decay,
                     "grad_clip": cfg.grad_clip, "compute_dtype": str(trainer.cdt), "compiled": cfg.compile,
                     "max_minutes": cfg.max_minutes, "planned_steps": trainer.total_steps,
                     "resumed_from_step": resumed["step"] if resumed else None,
                     "init_from": str(cfg.init_from) if cfg.init_from else None,
                     "grown_from": grown_from,
                     "init_layers": None if cfg.init_from or resumed else cfg.init_layers,
                     "final_loss": round(result.get("loss", float("nan")), 4),
                     "final_train_tau": round(result.get("train_tau", float("nan")), 3),
                     "final_accuracy_per_position": result.get("accuracy"),
                     "label_tokens_per_s": round(label_rate),
                     "curve": _thinned(trainer.history, 40),
                     "validation": {"fraction": cfg.val_fraction, "every": cfg.val_every, "held_out": int(n_val),
                                    "sequences": int(n_measured),
                                    "final": trainer.val_history[-1] if trainer.val_history else None,
                                    "curve": _thinned(trainer.val_history, 40)}},
        "eval": evals,
        "environment": {"mlx": mx.__version__, "device": str(mx.default_device()), "python": platform.python_version(),
                        "argv": sys.argv},
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    (out / "training_card.json").write_text(json.dumps(card, indent=1) + "\n")
    (out / "TRAINING.md").write_text(render_card(card))
    log(f"card: {out / 'training_card.json'}; total {card['wall_s']} s")
    return card


