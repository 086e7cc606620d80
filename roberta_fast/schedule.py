"""Learning-rate schedule of RoBERTa: linear warmup to the peak, then linear decay.

    sched = WarmupLinearDecay(peak_lr=6e-4, warmup_steps=24_000, total_steps=500_000)
    lr = sched.lr()          # the LR of the next update
    sched.step()             # after an update that was applied (not after a skipped one)

The schedule counts applied updates, not iterations: an fp16 step skipped for overflow
does not advance it (as fairseq's `num_updates`). Update u (0-based) uses
peak · (u + 1) / warmup during warmup, then decays linearly to `min_lr` at `total_steps`.
state_dict() / load_state_dict() make resume exact.
"""
from __future__ import annotations


class WarmupLinearDecay:
    """Linear warmup then linear decay; `lr()` is the learning rate of the next update."""

    def __init__(self, peak_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0):
        if not peak_lr > 0:
            raise ValueError(f"peak_lr must be > 0, got {peak_lr!r}")
        if not 0 <= warmup_steps <= total_steps or total_steps <= 0:
            raise ValueError(
                f"need 0 <= warmup_steps <= total_steps and total_steps > 0, got warmup_steps="
                f"{warmup_steps!r}, total_steps={total_steps!r}"
            )
        if not 0 <= min_lr <= peak_lr:
            raise ValueError(f"min_lr must be in [0, peak_lr={peak_lr}], got {min_lr!r}")
        self.peak_lr, self.min_lr = float(peak_lr), float(min_lr)
        self.warmup_steps, self.total_steps = int(warmup_steps), int(total_steps)
        self.num_updates = 0

    def lr_at(self, update: int) -> float:
        """The learning rate of (0-based) update `update`."""
        if update < self.warmup_steps:
            return self.peak_lr * (update + 1) / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        if decay_steps <= 0:
            return self.peak_lr
        left = max(0.0, (self.total_steps - update) / decay_steps)  # 1 at the peak, 0 at the end
        return self.min_lr + (self.peak_lr - self.min_lr) * left

    def lr(self) -> float:
        return self.lr_at(self.num_updates)

    def step(self) -> None:
        """Record one applied update."""
        self.num_updates += 1

    def state_dict(self) -> dict:
        return {"num_updates": self.num_updates, "peak_lr": self.peak_lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore the update count; the shape (peak, warmup, total) is the current config's."""
        self.num_updates = int(state["num_updates"])
