"""The record of one `Trainer.run`: loss-curve points every `log_every` steps, the progress bar, and
the throughput over the call."""
from __future__ import annotations

from typing import Optional

from tqdm import tqdm


class RunLog:
    """Sums per-step values into windows of `log_every` steps; each closed window is a loss-curve
    point (`point`) and updates the bar.

    Args:
        total_steps: the planned steps (the bar's end); initial: steps done before this call.
        log_every: steps per curve point.
        progress: show the tqdm bar.
    """

    def __init__(self, total_steps: int, initial: int, log_every: int, progress: bool):
        self.bar = tqdm(total=total_steps, initial=initial, desc="train", unit="step", disable=not progress,
                        dynamic_ncols=True)
        self.log_every = log_every
        self._window = {"loss": 0.0, "tau": 0.0, "n": 0, "labels": 0, "t": 0.0}
        self._total = {"labels": 0, "t": 0.0}
        self.last: dict = {}  # the last closed window: loss, train_tau, accuracy, label_tokens_per_s

    def add(self, loss: float, tau: float, labels: int, dt: float) -> None:
        """One retired step: its loss, teacher-forced tau, supervised block positions, wall seconds."""
        w = self._window
        w["loss"] += loss
        w["tau"] += tau
        w["n"] += 1
        w["labels"] += labels
        w["t"] += dt
        self._total["labels"] += labels
        self._total["t"] += dt

    def window_full(self) -> bool:
        """Whether `log_every` steps were added since the last point."""
        return self._window["n"] >= self.log_every

    def point(self, step: int, epoch: float, lr: float, grad_norm: float, accuracy: list[float],
              elapsed_s: float) -> Optional[dict]:
        """Closes the window (None if it is empty): the curve point after `step` (0-based) as the
        training card keeps it: step, epoch, loss, train_tau, lr, grad_norm, elapsed_s,
        label_tok_per_s."""
        w = self._window
        if not w["n"]:
            return None
        tps = w["labels"] / max(w["t"], 1e-9)
        self.last.update(loss=w["loss"] / w["n"], train_tau=w["tau"] / w["n"],
                         accuracy=[round(a, 4) for a in accuracy], label_tokens_per_s=tps)
        self.bar.set_postfix(loss=f"{self.last['loss']:.3f}", tau=f"{self.last['train_tau']:.2f}", lr=f"{lr:.2e}",
                             tok_s=f"{tps:,.0f}", ep=f"{epoch:.1f}")
        w.update(loss=0.0, tau=0.0, n=0, labels=0, t=0.0)
        return {"step": step + 1, "epoch": round(epoch, 3), "loss": round(self.last["loss"], 4),
                "train_tau": round(self.last["train_tau"], 3), "lr": lr, "grad_norm": round(grad_norm, 3),
                "elapsed_s": round(elapsed_s, 1), "label_tok_per_s": round(tps)}

    def summary(self) -> dict:
        """The last closed window's values, with "label_tokens_per_s" over every step added so far."""
        out = dict(self.last)
        if self._total["t"] > 0:
            out["label_tokens_per_s"] = self._total["labels"] / self._total["t"]
        return out
