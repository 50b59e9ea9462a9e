"""The training step: the learning-rate schedule and the (compiled) update of the draft.

One step is the draft's forward over a batch's blocks, the loss, backward, the gradient average
over ranks, clipping and AdamW, as one `mx.compile`d function traced once (fixed batch shapes).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from worker.models.dflash import Model


def learning_rate(progress: float, lr: float, warmup: float, min_lr_ratio: float = 0.0) -> float:
    """Linear warmup over the first `warmup` fraction, then cosine decay to lr * min_lr_ratio.

    Args:
        progress: fraction of the run done, in [0, 1] (steps or wall time, whichever is further).
        lr: peak learning rate.
        warmup: warmup fraction (paper: 0.04).
        min_lr_ratio: floor of the decay, as a fraction of lr.

    Returns:
        The learning rate (never exactly 0 during warmup).
    """
    p = min(max(progress, 0.0), 1.0)
    if warmup > 0 and p < warmup:
        return lr * max(p / warmup, 0.01)
    t = (p - warmup) / max(1.0 - warmup, 1e-9)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t)))




def build_step(draft: Model, opt: optim.Optimizer, loss: Callable, grad_clip: float,
               group: Optional[mx.distributed.Group], compile: bool) -> Callable:
    """The training step function.

    Args:
        draft: the draft whose trainable parameters are updated in place.
        opt: its optimizer (AdamW; the caller sets its learning rate before each step).
        loss: (tokens, lengths, anchors, keep, taps) -> (loss, accuracy (B-1,), tau), as
            `Trainer._loss`.
        grad_clip: global gradient norm cap (<= 0: none).
        group: data-parallel group (None: one process); gradients, loss, accuracy and tau are
            averaged over it and the clock summed (the step's only collectives).
        compile: `mx.compile` the step, with the draft's and the optimizer's state as inputs and
            outputs.

    Returns:
        step(tokens, lengths, anchors, keep, taps, clock) -> (loss, accuracy, tau, grad norm
        (before clipping), clock summed over ranks), all lazy mx.arrays.
    """
    w = 1 if group is None else group.size()
    loss_and_grad = nn.value_and_grad(draft, loss)

    def step(tokens, lengths, anchors, keep, taps, clock):
        (loss, acc, tau), grads = loss_and_grad(tokens, lengths, anchors, keep, taps)
        if group is not None:  # the step's only collectives, so ranks issue them in one order
            grads = nn.average_gradients(grads, group)
            loss, acc, tau = (mx.distributed.all_sum(x, group=group) / w for x in (loss, acc, tau))
            clock = mx.distributed.all_sum(clock, group=group)
        if grad_clip and grad_clip > 0:
            grads, gnorm = optim.clip_grad_norm(grads, grad_clip)
        else:
            gnorm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
        opt.update(draft, grads)
        return loss, acc, tau, gnorm, clock

    if compile:
        state = [draft.state, opt.state]
        step = partial(mx.compile, inputs=state, outputs=state)(step)
    return step
