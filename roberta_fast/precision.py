"""Mixed precision for the trainer: the autocast context and fp16's dynamic loss scaler.

fp32 master weights throughout: the parameters stay float32 and `torch.autocast` runs the
matmuls in fp16/bf16. fp16 needs loss scaling: the loss is multiplied by `scale` before
backward; when the gradients hold inf/NaN the update is skipped and the scale halves,
and after `window` finite steps in a row it doubles (Micikevicius et al. 2018; the
policy of apex / fairseq / torch.amp.GradScaler). bf16 and fp32 use a fixed scale of 1
(no scaling), but a non-finite step is still skipped and counted.
"""
from __future__ import annotations

import contextlib

import torch


def native_bf16(device: torch.device) -> bool:
    """Whether the GPU `device` computes in bf16 natively (sm_80+, or ROCm).

    Not torch.cuda.is_bf16_supported(): by default that also says yes where bf16 is
    only emulated (V100, T4), which is slow and has no Triton bf16 dot. The capability
    comes from ops.device_capability, the one place tests fake a GPU.
    """
    from .ops import device_capability

    if torch.version.hip:
        return True
    return device_capability(device) >= (8, 0)


def describe_auto(device: torch.device) -> tuple[str, str]:
    """(precision, why) for --precision auto on `device`, as the startup line states it.

    bf16 where the GPU computes it natively (sm_80+, ROCm): no loss scaling needed.
    fp16 with dynamic loss scaling on older CUDA GPUs (V100 sm_70, T4 sm_75): their tensor
    cores run fp16, not bf16, and fp32 there runs without tensor cores (about 8x slower on
    a V100). fp32 on the CPU, where the model runs for tests and small jobs.
    """
    if device.type != "cuda":
        return "fp32", f"fp32 on the {device.type.upper()} (no CUDA GPU)"
    from .ops import device_capability

    if native_bf16(device):
        return "bf16", "bf16 autocast: the GPU computes bf16 natively (sm_80+ or ROCm)"
    major, minor = device_capability(device)
    return "fp16", (f"fp16 autocast with dynamic loss scaling: sm_{major}{minor} has fp16 tensor cores "
                    "but no native bf16")


def resolve_precision(precision: str, device: torch.device) -> str:
    """"auto" -> describe_auto's choice (bf16 on sm_80+, fp16 on older CUDA GPUs, fp32 on the CPU);
    checks the others are usable on `device`."""
    if precision == "auto":
        return describe_auto(device)[0]
    if precision not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"precision must be auto, fp32, fp16 or bf16, got {precision!r}")
    if precision == "bf16" and device.type == "cuda" and not native_bf16(device):
        raise ValueError(f"precision bf16 is not supported on {torch.cuda.get_device_name(device)} "
                         "(no native bf16 below sm_80); use fp16 (with loss scaling), which --precision auto picks")
    return precision


def explain(requested: str, device: torch.device) -> str:
    """Why the run computes in the precision it does: the startup description's words."""
    if requested == "auto":
        return f"--precision auto -> {describe_auto(device)[1]}"
    return f"--precision {requested}, as asked"


def autocast(precision: str, device: torch.device):
    """The forward's autocast context for `precision` (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


class DynamicLossScaler:
    """Loss scale that halves on overflow and doubles after `window` clean steps.

    enabled=False (bf16, fp32): the scale stays 1.0 but overflow steps are still counted.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, window: int = 1000, factor: float = 2.0,
                 min_scale: float = 2.0 ** -14, enabled: bool = True):
        if init_scale <= 0 or window < 1 or factor <= 1:
            raise ValueError(f"need init_scale > 0, window >= 1, factor > 1; got {init_scale}, {window}, {factor}")
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.window, self.factor, self.min_scale = int(window), float(factor), float(min_scale)
        self.good_steps = 0  # finite steps since the last change of scale
        self.skipped = 0  # overflow steps in all
        self.bad_in_a_row = 0  # consecutive overflow steps (a persistent NaN stops the run)

    def update(self, found_inf: bool) -> None:
        """Record one step: halve on overflow, double after `window` finite steps."""
        if found_inf:
            self.skipped += 1
            self.bad_in_a_row += 1
            self.good_steps = 0
            if self.enabled:
                self.scale = max(self.scale / self.factor, self.min_scale)
            return
        self.bad_in_a_row = 0
        self.good_steps += 1
        if self.enabled and self.good_steps >= self.window:
            self.scale *= self.factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped,
                "bad_in_a_row": self.bad_in_a_row, "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        if bool(state["enabled"]) == self.enabled:  # a precision change keeps this run's scale
            self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state["skipped"])
        self.bad_in_a_row = int(state["bad_in_a_row"])
