"""TrainConfig: every knob of `python -m roberta_fast.train`, its recipe presets and its CLI.

    cfg = TrainConfig.preset("base", max_steps=1000)       # the paper's recipe, overridden
    cfg = load_config(argv)                                # --config file, --preset, one flag per field

Precedence, lowest first: the dataclass defaults, the recipe preset (`--preset`, or the
one named in the config file), the `--config` file (YAML or JSON), then the command-line
flags. Every field has a flag: `max_steps` is `--max-steps`, booleans take
`--flag` / `--no-flag`. `validate()` rejects impossible values with one message listing
every problem, before any data or weights are touched.

Presets (`TRAIN_PRESETS`): "tiny" trains on 2 CPU cores in minutes; "base" and "large"
are the RoBERTa paper's pretraining hyperparameters (Liu et al. 2019, appendix table 9:
batch 8K sequences of 512 tokens, 500k steps, peak LR 6e-4 / 4e-4, warmup 24k / 30k,
Adam β 0.9/0.98, ε 1e-6, weight decay 0.01, no gradient clipping); "base_fairseq" is
fairseq's single-node base recipe (batch 2048, LR 5e-4, warmup 10k, 125k updates);
"spanbert" is SpanBERT's (Joshi et al. 2019, and the command in its released code: BERT-large
sizes, batch 256 x 512 tokens, 2.4M steps, LR 1e-4, warmup 10k, Adam β2 0.999 ε 1e-8, clipping
1.0, span masking + the span boundary objective).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

PRECISIONS = ("auto", "fp32", "fp16", "bf16")
MASKINGS = ("token", "whole_word", "span")
OBJECTIVES = ("mlm", "mlm+sbo")  # mlm+sbo: SpanBERT (roberta_fast.sbo)
MODES = ("full", "doc")  # FULL-SENTENCES, DOC-SENTENCES (roberta_fast.data)
MODEL_PRESETS = ("tiny", "base", "large")
# Permissions for one invocation: given on the command line only, never saved with the
# run nor read from a --config file (which may come from someone else).
COMMAND_LINE_ONLY = ("trust_checkpoint", "allow_schedule_change")


@dataclass
class TrainConfig:
    """One training run. `global_batch_size = batch_size * grad_accum * world_size` sequences."""

    # what to train
    model: str = "tiny"  # model size (RobertaConfig preset): tiny | base | large
    hidden_size: int | None = None  # hidden width, overriding the model preset's
    num_hidden_layers: int | None = None  # encoder layers (None: the preset's)
    num_attention_heads: int | None = None  # attention heads (None: the preset's)
    intermediate_size: int | None = None  # feed-forward width (None: the preset's)
    dropout: float | None = None  # hidden and attention dropout (None: the preset's 0.1)
    backend: str = "auto"  # model backend: auto | fused | reference
    activation_checkpointing: bool = False  # recompute each layer's activations in the backward pass: less memory, ~1/3 more compute
    init_from: str | None = None  # an HF model directory or Hub name to start from, not random weights
    # data
    data: str | None = None  # dataset directory (roberta_fast.preprocess); None: the embedded corpus
    seq_len: int = 128  # tokens per sequence (<s> included)
    mode: str = "full"  # full (FULL-SENTENCES) | doc (DOC-SENTENCES)
    pack: bool = False  # doc mode: pack several documents per row, attention kept inside each
    data_checksums: bool = True  # verify the shards' checksums at start: one read of the data (sizes: always)
    masking: str = "token"  # token | whole_word | span
    objective: str = "mlm"  # mlm | mlm+sbo (SpanBERT's span boundary objective beside the MLM; needs --masking span)
    mlm_probability: float = 0.15  # share of tokens predicted
    mask_replace_prob: float = 0.8  # of those, replaced by <mask>
    random_replace_prob: float = 0.1  # of those, replaced by a random token
    # batch
    batch_size: int = 16  # sequences per micro-step per process
    grad_accum: int | None = None  # micro-steps per optimizer step (None: from global_batch_size)
    global_batch_size: int | None = None  # sequences per optimizer step over all processes
    # optimisation
    max_steps: int = 300  # optimizer steps of the whole run, fp16 overflow-skipped ones included (as transformers' Trainer counts): the LR reaches min_lr here only if none was skipped
    lr: float = 2e-3  # peak learning rate
    warmup_steps: int = 30  # linear warmup to the peak
    min_lr: float = 0.0  # the linear decay ends here, after max_steps applied (not skipped) updates
    weight_decay: float = 0.01  # decoupled (AdamW), not on biases and LayerNorm
    beta1: float = 0.9  # Adam beta1
    beta2: float = 0.98  # Adam beta2
    eps: float = 1e-6  # Adam epsilon
    clip_grad_norm: float = 1.0  # 0: no clipping (the paper's choice)
    precision: str = "auto"  # auto (bf16 on sm_80+, fp16 + loss scaling on older GPUs, fp32 on CPU) | fp32 | fp16 | bf16
    init_loss_scale: float = 2.0 ** 16  # fp16 dynamic loss scaling
    loss_scale_window: int = 1000  # finite steps before the scale doubles
    max_bad_steps: int = 25  # consecutive non-finite steps that stop the run
    seed: int = 0  # data order, masks, initial weights, dropout
    # where and how often
    out: str | None = None  # output directory (None: runs/<model>)
    resume: str = "auto"  # auto (latest checkpoint in out, if any) | never | a checkpoint path
    allow_schedule_change: bool = False  # resume with a changed LR schedule (--max-steps, --warmup-steps, --lr, --min-lr)
    trust_checkpoint: bool = False  # load an old-format checkpoint that needs full unpickling (can run code: only files you wrote)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    eval_every: int = 100  # steps between validation runs
    eval_batches: int = 8  # validation batches (of batch_size sequences) per evaluation
    log_every: int = 10  # steps between metrics.jsonl lines
    save_every: int = 100  # steps between checkpoints
    keep_checkpoints: int = 2  # checkpoints kept (the newest)
    stop_at: int | None = None  # checkpoint and exit after this step (time-sliced jobs)
    prefetch: int = 4  # batches prepared ahead of the GPU
    progress: bool = True  # tqdm progress bar when stderr is a terminal (else one line per logged step)
    tensorboard: bool = True  # TensorBoard scalars (if installed)
    wandb_project: str | None = None  # also log to this Weights & Biases project (pip install wandb; WANDB_MODE=offline logs without an account); a resumed run goes on with its W&B run (default: none)
    plot: bool = True  # loss.png (training and validation loss) at the end
    export: bool = True  # save <out>/final in Hugging Face format at the end

    # ------------------------------------------------------------------ derived
    @property
    def out_dir(self) -> Path:
        return Path(self.out if self.out is not None else os.path.join("runs", self.model))

    def resolve_batch(self, world_size: int) -> tuple[int, int]:
        """(grad_accum, global_batch_size) for `world_size` processes; ValueError if inconsistent."""
        per_step = self.batch_size * world_size
        if self.grad_accum is None and self.global_batch_size is None:
            return 1, per_step
        if self.grad_accum is None:
            if self.global_batch_size % per_step:
                raise ValueError(
                    f"global_batch_size {self.global_batch_size} is not a multiple of batch_size "
                    f"{self.batch_size} x {world_size} processes = {per_step}; change --batch-size or "
                    f"--global-batch-size, or set --grad-accum"
                )
            return self.global_batch_size // per_step, self.global_batch_size
        total = per_step * self.grad_accum
        if self.global_batch_size is not None and self.global_batch_size != total:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} != batch_size {self.batch_size} x "
                f"grad_accum {self.grad_accum} x {world_size} processes = {total}; set only two of them"
            )
        return self.grad_accum, total

    # ------------------------------------------------------------------ checks
    def validate(self) -> "TrainConfig":
        """Raise ValueError listing every impossible value; return self."""
        errors = []

        def check(ok, msg):
            if not ok:
                errors.append(msg)

        def positive(name, allow_none=False, allow_zero=False):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            is_int = isinstance(v, int) and not isinstance(v, bool)
            check(is_int and (v >= 0 if allow_zero else v > 0),
                  f"{name} must be a {'non-negative' if allow_zero else 'positive'} integer, got {v!r}")

        for name in ("seq_len", "batch_size", "max_steps", "eval_batches", "log_every", "eval_every",
                     "save_every", "keep_checkpoints", "loss_scale_window", "max_bad_steps", "prefetch"):
            positive(name)
        for name in ("grad_accum", "global_batch_size", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "intermediate_size", "stop_at"):
            positive(name, allow_none=True)
        positive("warmup_steps", allow_zero=True)
        check(isinstance(self.seed, int) and 0 <= self.seed < 2 ** 63, f"seed must be an int in [0, 2^63), got {self.seed!r}")
        check(self.model in MODEL_PRESETS, f"model must be one of {MODEL_PRESETS}, got {self.model!r}")
        check(self.backend in ("auto", "fused", "reference"),
              f"backend must be auto, fused or reference, got {self.backend!r}")
        check(self.precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        check(self.masking in MASKINGS, f"masking must be one of {MASKINGS}, got {self.masking!r}")
        check(self.objective in OBJECTIVES, f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        check(self.objective != "mlm+sbo" or self.masking == "span",
              f"objective mlm+sbo needs --masking span (the SBO predicts masked spans from their "
              f"boundaries), got masking {self.masking!r}")
        check(self.mode in MODES, f"mode must be one of {MODES}, got {self.mode!r}")
        check(not self.pack or self.mode == "doc", "pack packs whole documents into rows: use it with --mode doc")
        check(0.0 < self.mlm_probability < 1.0, f"mlm_probability must be in (0, 1), got {self.mlm_probability!r}")
        check(0.0 <= self.mask_replace_prob and 0.0 <= self.random_replace_prob
              and self.mask_replace_prob + self.random_replace_prob <= 1.0,
              "mask_replace_prob and random_replace_prob must be >= 0 and sum to at most 1, got "
              f"{self.mask_replace_prob!r} + {self.random_replace_prob!r}")
        check(self.dropout is None or 0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout!r}")
        for name in ("lr", "min_lr", "weight_decay", "eps", "init_loss_scale"):  # inf passes the checks below
            value = getattr(self, name)
            check(not isinstance(value, float) or math.isfinite(value), f"{name} must be finite, got {value!r}")
        check(self.lr > 0, f"lr must be > 0, got {self.lr!r}")
        check(0.0 <= self.min_lr <= self.lr, f"min_lr must be in [0, lr={self.lr}], got {self.min_lr!r}")
        check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay!r}")
        check(0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0,
              f"beta1 and beta2 must be in [0, 1), got {self.beta1!r}, {self.beta2!r}")
        check(self.eps > 0, f"eps must be > 0, got {self.eps!r}")
        check(self.clip_grad_norm >= 0, f"clip_grad_norm must be >= 0 (0 disables clipping), got {self.clip_grad_norm!r}")
        check(self.init_loss_scale > 0, f"init_loss_scale must be > 0, got {self.init_loss_scale!r}")
        if isinstance(self.warmup_steps, int) and isinstance(self.max_steps, int):
            check(self.warmup_steps <= self.max_steps,
                  f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        if isinstance(self.stop_at, int) and isinstance(self.max_steps, int):
            check(self.stop_at <= self.max_steps, f"stop_at ({self.stop_at}) must not exceed max_steps ({self.max_steps})")
        from .metrics import wandb_missing

        missing = wandb_missing(self.wandb_project)
        check(not missing, missing)
        check(self.resume in ("auto", "never") or bool(self.resume),
              f"resume must be auto, never or a checkpoint path, got {self.resume!r}")
        if self.grad_accum is not None and self.global_batch_size is not None and not errors:
            if self.global_batch_size % (self.batch_size * self.grad_accum):
                errors.append(
                    f"global_batch_size {self.global_batch_size} is not batch_size {self.batch_size} x "
                    f"grad_accum {self.grad_accum} x a whole number of processes"
                )
        if errors:
            raise ValueError("invalid training config:\n  - " + "\n  - ".join(errors))
        return self

    # ------------------------------------------------------------------ presets / io
    @classmethod
    def preset(cls, name: str, **overrides) -> "TrainConfig":
        """The recipe preset `name` (see TRAIN_PRESETS) with `overrides` applied.

        A run shorter than the preset's (`max_steps` given, `warmup_steps` not) keeps the
        preset's warmup share: see `fit_preset_warmup`."""
        if name not in TRAIN_PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(TRAIN_PRESETS)}")
        cfg = cls.from_dict({**TRAIN_PRESETS[name], **overrides})
        if "warmup_steps" not in overrides:
            cfg.warmup_steps = fit_preset_warmup(name, cfg.max_steps)
        return cfg

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """Build from a mapping of field names (dashes allowed); unknown keys are an error."""
        data = {str(k).replace("-", "_"): v for k, v in data.items()}
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown training config keys {unknown}; valid keys: {sorted(names)}")
        return cls(**{k: _coerce(k, v) for k, v in data.items()})

    def to_dict(self) -> dict:
        """The run's settings, without the per-invocation permissions (COMMAND_LINE_ONLY)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in COMMAND_LINE_ONLY}

    def save(self, path: str | os.PathLike) -> None:
        """Write the config as JSON via a temporary file and a rename."""
        from .files import write_text_atomic

        write_text_atomic(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")


# Recipe presets: training fields only; model sizes come from RobertaConfig.preset(model).
TRAIN_PRESETS: dict[str, dict[str, Any]] = {
    # 2 CPU cores, a few minutes: 2 layers, hidden 128, 128-token sequences.
    "tiny": dict(model="tiny", seq_len=128, batch_size=16, max_steps=300, lr=2e-3, warmup_steps=30,
                 clip_grad_norm=1.0, eval_every=100, eval_batches=8, log_every=10, save_every=100),
    # RoBERTa paper, base: 8K x 512 tokens, 500k steps, peak 6e-4 after 24k warmup, no clipping.
    "base": dict(model="base", seq_len=512, batch_size=32, global_batch_size=8192, max_steps=500_000,
                 lr=6e-4, warmup_steps=24_000, clip_grad_norm=0.0, eval_every=2000, eval_batches=50,
                 log_every=50, save_every=2000, keep_checkpoints=3),
    # RoBERTa paper, large: 8K x 512 tokens, 500k steps, peak 4e-4 after 30k warmup, no clipping.
    "large": dict(model="large", seq_len=512, batch_size=16, global_batch_size=8192, max_steps=500_000,
                  lr=4e-4, warmup_steps=30_000, clip_grad_norm=0.0, eval_every=2000, eval_batches=50,
                  log_every=50, save_every=2000, keep_checkpoints=3),
    # fairseq's single-node base recipe: 2048 x 512 tokens, 125k updates, peak 5e-4 after 10k.
    "base_fairseq": dict(model="base", seq_len=512, batch_size=16, global_batch_size=2048,
                         max_steps=125_000, lr=5e-4, warmup_steps=10_000, clip_grad_norm=0.0,
                         eval_every=2000, eval_batches=50, log_every=50, save_every=2000,
                         keep_checkpoints=3),
    # SpanBERT (Joshi et al. 2019; its released pretraining command): BERT-large sizes, 256 x 512
    # tokens (DOC-SENTENCES), 2.4M steps, peak 1e-4 after 10k warmup, Adam beta2 0.999 eps 1e-8,
    # clipping at 1.0, geometric span masking with the span boundary objective.
    "spanbert": dict(model="large", seq_len=512, mode="doc", masking="span", objective="mlm+sbo", batch_size=8,
                     global_batch_size=256, max_steps=2_400_000, lr=1e-4, warmup_steps=10_000, beta2=0.999,
                     eps=1e-8, weight_decay=0.01, clip_grad_norm=1.0, eval_every=2000, eval_batches=50,
                     log_every=50, save_every=2000, keep_checkpoints=3),
}


def fit_preset_warmup(preset: str, max_steps) -> int:
    """The preset's warmup, or, for a run shorter than the preset's, the same share of the run
    (at least 1 step), so that the shorter run keeps the schedule's shape: warmup, then decay.
    `--max-steps 12` of "tiny" (30 of 300 steps) warms up for 1 step, `--max-steps 30` for 3
    (the preset's 30 would be warmup alone, never decaying); `--preset base --max-steps 100000`
    for 4,800 (24k of 500k). A run as long as the preset's or longer keeps the preset's warmup."""
    values = TRAIN_PRESETS[preset]
    warmup = values["warmup_steps"]
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or not 0 < max_steps < values["max_steps"]:
        return warmup  # the preset's length or longer, or an invalid max_steps that validate() reports
    return min(max_steps, max(1, round(warmup * max_steps / values["max_steps"])))


# ---------------------------------------------------------------------- parsing
def _field_types() -> dict[str, tuple[type, bool]]:
    """field name -> (base type, optional)."""
    hints = typing.get_type_hints(TrainConfig)
    out = {}
    for f in fields(TrainConfig):
        t = hints[f.name]
        args = typing.get_args(t)
        optional = type(None) in args
        if typing.get_origin(t) in (typing.Union, types.UnionType):
            t = next(a for a in args if a is not type(None))
        out[f.name] = (t, optional)
    return out


def _coerce(name: str, value):
    """Convert a value read from a file or the command line to the field's type."""
    base, optional = _field_types()[name]
    if isinstance(value, str) and not value.strip():
        # an unset shell variable (--init-from "$CKPT") must not quietly mean the default
        raise ValueError(f"{name} is empty: give a value, or leave it out for its default")
    if value is None or (optional and base is not str and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ValueError(f"{name} cannot be empty")
    try:
        if base is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if base is int:
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, str):
                f = float(value)  # accepts "8192", "5e5"
                if not f.is_integer():
                    raise ValueError(value)
                return int(f)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(value)
            return value
        if base is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        # text: a number is its spelling (YAML reads `out: 2024` as an int); a list, mapping or bool is a mistake
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(value)
        return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} expects {'an' if base is int else 'a'} {base.__name__}, got {value!r}") from None


def read_config_file(path: str | os.PathLike) -> dict:
    """The mapping in a .json / .yaml / .yml file (YAML needs PyYAML)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{path} is YAML, which needs PyYAML (`pip install pyyaml`); or use JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{path} is not valid YAML: {err}") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
    else:
        raise ValueError(f"config file {str(path)!r} must end in .json, .yaml or .yml")
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of config keys to values, got {type(data).__name__}")
    return data


def field_help(cls=None) -> dict[str, str]:
    """field name -> its comment in the source of dataclass `cls` (default TrainConfig): the
    CLI help of each flag; {} without source."""
    try:
        source = inspect.getsource(cls or TrainConfig)
    except (OSError, TypeError):
        return {}
    found = re.findall(r"^    (\w+): [^\n#]*#\s*(.+)$", source, flags=re.M)
    return {name: text.replace("%", "%%") for name, text in found}  # argparse formats help with %


def build_parser() -> argparse.ArgumentParser:
    """The CLI: --config, --preset and one flag per TrainConfig field (default: not given)."""
    p = argparse.ArgumentParser(
        prog="python -m roberta_fast.train",
        description="Pretrain RoBERTa (MLM). With no arguments: the tiny preset on the embedded corpus.",
    )
    p.add_argument("--config", help="YAML or JSON file of config fields (flags override it; default: none)")
    p.add_argument("--preset", choices=sorted(TRAIN_PRESETS), help="recipe preset (default: tiny)")
    defaults, helps = TrainConfig(), field_help()
    for name, (base, optional) in _field_types().items():
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        if base is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{helps.get(name, '')} (default {default})")
        else:
            p.add_argument(flag, dest=name, default=None, metavar=base.__name__.upper(),
                           help=f"{helps.get(name, '')} (default {default})")
    return p


def parse_args_once(parser, argv=None):
    """parser.parse_args(argv), where under torchrun only rank 0 prints a usage error or --help (every rank
    still exits), not once per process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0:
        parser.error = lambda message: sys.exit(2)
        parser.print_help = lambda file=None: None
    return parser.parse_args(argv)


def load_config(argv=None) -> TrainConfig:
    """The effective, validated TrainConfig for command-line `argv`."""
    args = vars(parse_args_once(build_parser(), argv))
    file_values = read_config_file(args.pop("config")) if args.get("config") else {}
    file_values = {str(k).replace("-", "_"): v for k, v in file_values.items()}
    for key in COMMAND_LINE_ONLY:
        if key in file_values:
            raise ValueError(f"{key} cannot be set in a --config file: pass --{key.replace('_', '-')} on the "
                             "command line for this run")
    file_preset = file_values.pop("preset", None)  # not a field: popped even when --preset overrides it
    preset = args.pop("preset") or file_preset or "tiny"
    if preset not in TRAIN_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(TRAIN_PRESETS)}")
    flags = {k: v for k, v in args.items() if v is not None}
    cfg = TrainConfig.preset(preset, **{**file_values, **flags}).validate()
    # (not a field: a resumed run keeps its checkpoint's warmup when the command leaves it to the preset,
    # e.g. one started when the preset's share of a shorter run was computed otherwise)
    cfg.warmup_from_preset = "warmup_steps" not in {**file_values, **flags}
    preset_warmup = TRAIN_PRESETS[preset]["warmup_steps"]
    if cfg.warmup_from_preset and cfg.warmup_steps != preset_warmup \
            and os.environ.get("RANK", "0") == "0":  # one line per job under torchrun
        preset_steps = TRAIN_PRESETS[preset]["max_steps"]
        print(f"note: the {preset} preset warms up for {preset_warmup} of its {preset_steps} steps: "
              f"--max-steps {cfg.max_steps} warms up for {cfg.warmup_steps} step(s), the same "
              f"{preset_warmup / preset_steps:.1%} of the run (--warmup-steps sets it)")
    return cfg
