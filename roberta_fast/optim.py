"""Fused AdamW for pretraining: `FusedAdam` and `param_groups_for_weight_decay`.

AdamW (decoupled weight decay, bias correction) with RoBERTa's defaults
β = (0.9, 0.98), ε = 1e-6, weight decay 0.01, computed by roberta_fast._C: on CUDA
in a handful of multi-tensor launches per step (apex's multi_tensor_apply
pattern, csrc/fused_adam_cuda.cu), on the CPU with OpenMP (csrc/fused_adam.cpp),
both with the per-element math of csrc/adam_math.h in fp32.

Mixed precision is fused in: parameters may be fp32, fp16 or bf16 (the low
precision ones keep fp32 master weights by default, the V100 fp16 recipe),
gradients any of those dtypes; `step(grad_scale=...)` divides the gradients by
the loss scale, and when the gradients hold inf/NaN the step is skipped on the
device (parameters, moments and step counts untouched) and
`found_inf`/`last_step_skipped` say so. `clip_grad_norm_` computes the global
gradient norm in one pass and the clip factor is applied inside the next step.
Nothing syncs with the host until `last_step_skipped` or the norm is read.

State per parameter (torch.optim.AdamW's names): "step" (fp32 scalar tensor on
the parameter's device), "exp_avg", "exp_avg_sq" (fp32) and, with master
weights, "master_param" (fp32). state_dict() / load_state_dict() round-trip
exactly and move the state to the parameters' device, so a checkpoint can go
between CPU and GPU.
"""
from collections import defaultdict

import torch

from . import _ext

_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def param_groups_for_weight_decay(model, weight_decay=0.01):
    """Two parameter groups for `model`: matrices and embeddings with `weight_decay`,
    biases and LayerNorm weights (every parameter of fewer than 2 dims) without, as BERT's
    and transformers' trainers do (fairseq's RoBERTa decays every parameter). Frozen parameters
    and empty groups are left out."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay)},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class FusedAdam(torch.optim.Optimizer):
    """AdamW with fused mixed-precision unscaling, overflow skipping and clipping.

    FusedAdam(params, lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01,
              master_weights=None)
    master_weights (per group): None keeps fp32 master weights for fp16/bf16
    parameters, False updates them in place (fp32 math, rounded on store); fp32
    parameters never need them.

    Typical mixed-precision use, with `scale` the loss scale as a tensor:
        (loss * scale).backward()
        norm = opt.clip_grad_norm_(1.0, grad_scale=scale)   # optional
        opt.step(grad_scale=scale)
        opt.found_inf       # device bool tensor: the step was skipped (no sync)
        opt.last_step_skipped  # the same as a Python bool (syncs)
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01,
                 master_weights=None):
        if not 0.0 <= lr:
            raise ValueError(f"FusedAdam: lr={lr} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"FusedAdam: betas={betas} must each be in [0, 1)")
        if not 0.0 <= eps:
            raise ValueError(f"FusedAdam: eps={eps} must be >= 0")
        if not 0.0 <= weight_decay:
            raise ValueError(f"FusedAdam: weight_decay={weight_decay} must be >= 0")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        master_weights=master_weights)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in _FLOAT_TYPES:
                    raise TypeError(f"FusedAdam: parameters must be float32, float16 or bfloat16, "
                                    f"got {p.dtype}; convert the model with .float()")
        self.found_inf = None     # device bool tensor after a step checked for overflow
        self._pending_clip = None  # (sum of squares, max_norm) from clip_grad_norm_

    # ------------------------------------------------------------------ helpers
    def _grads(self):
        """(param, grad) of every parameter with a gradient, checked."""
        pairs, device = [], None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise TypeError("FusedAdam does not support sparse gradients")
                if g.dtype not in _FLOAT_TYPES:
                    raise TypeError(f"FusedAdam: gradients must be float32, float16 or bfloat16, "
                                    f"got {g.dtype}")
                if not p.is_contiguous():
                    raise ValueError("FusedAdam: parameters must be contiguous; make the parameter "
                                     "contiguous (p.data = p.data.contiguous())")
                if not g.is_contiguous():
                    raise ValueError("FusedAdam: gradients must be contiguous; a hook or custom "
                                     "backward gave a non-contiguous .grad: make it contiguous "
                                     "(p.grad = p.grad.contiguous()) before step()")
                device = device or p.device
                if p.device != device or g.device != device:
                    raise ValueError(f"FusedAdam: parameters and gradients are on {device} and "
                                     f"{p.device if p.device != device else g.device}; put the "
                                     "whole model on one device")
                pairs.append((p, g))
        return pairs, device

    @staticmethod
    def _scale_tensor(grad_scale, device):
        """The loss scale as a float32 one-element tensor on `device`."""
        if grad_scale is None:
            return None
        if not isinstance(grad_scale, torch.Tensor):
            return torch.full((), float(grad_scale), dtype=torch.float32, device=device)
        if grad_scale.numel() != 1:
            raise ValueError("FusedAdam: grad_scale must have one element")
        if grad_scale.device != device:
            raise ValueError(f"FusedAdam: grad_scale is on {grad_scale.device}, the parameters "
                             f"on {device}; pass the scale tensor of the parameters' device")
        return grad_scale.reshape(()).float()

    def _init_state(self, p, group):
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32,
                                                memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        if (p.dtype != torch.float32 and group["master_weights"] is not False
                and "master_param" not in state):  # also a loaded state without one (an fp32 run's)
            state["master_param"] = p.detach().float().contiguous()
        return state

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, grad_scale=None):
        """Global L2 norm of the gradients divided by grad_scale, in one pass; the
        next step() multiplies the gradients by min(1, max_norm / (norm + 1e-6)) as
        torch.nn.utils.clip_grad_norm_ would, and skips if the norm is not finite.
        Returns the norm as a device tensor (no host sync). Pass the same grad_scale
        to step() (ValueError otherwise; the same tensor object needs no host sync)."""
        if not max_norm > 0:
            raise ValueError(f"FusedAdam.clip_grad_norm_: max_norm={max_norm} must be > 0")
        pairs, device = self._grads()
        if not pairs:
            raise ValueError("FusedAdam.clip_grad_norm_: no parameter has a gradient")
        sumsq = _ext.load().grad_sumsq([g for _, g in pairs], self._scale_tensor(grad_scale, device))
        self._pending_clip = (sumsq, float(max_norm), grad_scale)
        return sumsq.sqrt()

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None):
        """One AdamW step over every parameter that has a gradient.

        grad_scale: the loss scale (tensor, or number) the gradients are multiplied
        by; they are divided by it, checked for inf/NaN, and on overflow the whole
        step is skipped (see found_inf / last_step_skipped). Returns closure's loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        C = _ext.load()
        pairs, device = self._grads()
        sumsq, max_norm, clip_scale = self._pending_clip or (None, 0.0, grad_scale)
        if not _same_scale(clip_scale, grad_scale):  # the norm was of other gradients than these
            raise ValueError(f"FusedAdam: clip_grad_norm_ was given grad_scale={_describe(clip_scale)}, step() "
                             f"grad_scale={_describe(grad_scale)}; pass the same loss scale to both")
        self._pending_clip = None
        if not pairs:
            self.found_inf = None
            return loss
        scale = self._scale_tensor(grad_scale, device)
        if sumsq is None and scale is not None:
            sumsq = C.grad_sumsq([g for _, g in pairs], scale)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            # One call per kind: with or without master weights.
            lists = defaultdict(lambda: ([], [], [], [], [], []))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p, group)
                master = state.get("master_param")
                ps, gs, ms, vs, ws, steps = lists[master is not None]
                ps.append(p)
                gs.append(p.grad)
                ms.append(state["exp_avg"])
                vs.append(state["exp_avg_sq"])
                steps.append(state["step"])
                if master is not None:
                    ws.append(master)
            for ps, gs, ms, vs, ws, steps in lists.values():
                C.adam_step(ps, gs, ms, vs, ws, steps, float(group["lr"]), float(beta1),
                            float(beta2), float(group["eps"]), float(group["weight_decay"]),
                            scale, sumsq, max_norm)
        self.found_inf = None if sumsq is None else ~torch.isfinite(sumsq)
        return loss

    @property
    def last_step_skipped(self):
        """True when the last step found inf/NaN gradients and changed nothing.
        Reading it syncs with the device; `found_inf` is the tensor."""
        return bool(self.found_inf) if self.found_inf is not None else False

    def load_state_dict(self, state_dict):
        """Loads a state_dict() of a FusedAdam, or of torch.optim.AdamW, over the same parameter
        groups. Every state tensor moves to its parameter's device as fp32, the dtype the update
        keeps moments and master weights in (torch's optimizers cast them to an fp16 parameter's
        dtype, and torch's AdamW on fp16 parameters saves fp16 moments); "step" becomes an fp32
        scalar tensor. fp16/bf16 parameters whose saved state has no master weights (an fp32 run
        resumed in fp16) get them from the parameter at the next step, as a fresh optimizer would.
        torch.optim.Adam's L2 weight decay is refused, except from torch < 2.7, whose Adam and AdamW
        save alike (no "decoupled_weight_decay"): such a state loads as AdamW's."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"FusedAdam.load_state_dict: {len(saved_groups)} parameter groups "
                             f"saved, {len(self.param_groups)} in this optimizer")
        index = {}
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("FusedAdam.load_state_dict: a parameter group's size differs "
                                 "from the saved one; build the optimizer over the same groups")
            unlike = [name for name, on in (  # torch's optimizers: updates FusedAdam does not compute
                ("amsgrad=True", saved.get("amsgrad")), ("maximize=True", saved.get("maximize")),
                ("L2 weight decay (torch.optim.Adam)",
                 saved.get("decoupled_weight_decay") is False and saved.get("weight_decay", 0) != 0)) if on]
            if unlike:
                raise ValueError(f"FusedAdam.load_state_dict: the saved optimizer used {', '.join(unlike)}, which "
                                 "FusedAdam (AdamW) does not compute; start the optimizer afresh instead")
            index.update(zip(saved["params"], group["params"]))
        state = defaultdict(dict)
        for key, values in state_dict["state"].items():
            p = index[key]
            for name, v in values.items():
                if name == "step":  # a number or a float64 tensor (other writers): the fp32 scalar step() takes
                    v = torch.as_tensor(v).to(device=p.device, dtype=torch.float32, copy=True).reshape(())
                elif isinstance(v, torch.Tensor):
                    if v.numel() != p.numel():
                        raise ValueError(f"FusedAdam.load_state_dict: saved {name} has {v.numel()} "
                                         f"elements, its parameter {p.numel()}")
                    v = v.to(device=p.device, dtype=torch.float32, copy=True)
                state[p][name] = v
        # every saved group key, as torch's optimizers keep them (an LR scheduler's initial_lr, a user's
        # own keys), but torch's implementation switches, which FusedAdam does not take
        groups = [{**group, **{k: v for k, v in saved.items() if k not in _TORCH_ONLY_KEYS and k != "params"},
                   "params": group["params"]} for saved, group in zip(saved_groups, self.param_groups)]
        self.__setstate__({"state": state, "param_groups": groups})
        self.found_inf, self._pending_clip = None, None


# torch.optim.Adam(W)'s switches of how it computes: not FusedAdam's settings, dropped on load
_TORCH_ONLY_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable", "maximize", "amsgrad",
                              "decoupled_weight_decay"})


def _same_scale(a, b) -> bool:
    """Whether two grad_scale arguments (None: 1) are the same scale; two tensor objects are
    compared by value, a host sync (one tensor passed to both is not)."""
    if a is b:
        return True
    return float(1.0 if a is None else a) == float(1.0 if b is None else b)


def _describe(scale) -> str:
    return f"tensor({float(scale)})" if isinstance(scale, torch.Tensor) else repr(scale)
