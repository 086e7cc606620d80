"""`python -m roberta_fast.finetune`: fine-tune a RoBERTa checkpoint on a classification,
token classification, question answering or multiple-choice task.

    python -m roberta_fast.finetune --model runs/tiny/final --train train.csv --valid dev.csv \
        --text-field sentence --label-field label --out runs/cls
    python -m roberta_fast.finetune --task token --train train.conll --valid dev.conll ...
    python -m roberta_fast.finetune --task qa --train train-v2.0.json --valid dev-v2.0.json ...
    python -m roberta_fast.finetune --task choice --train race_train.jsonl --valid race_dev.jsonl ...
    torchrun --nproc_per_node 8 -m roberta_fast.finetune --task qa ...

--task classify (the default): CSV, GLUE's .tsv as shipped (tab-separated, no quoting; CoLA's,
which has no header row, by column number: --text-field 3 --label-field 1) or JSONL rows
holding a text, optionally a second text (a pair, encoded `<s> a </s></s> b </s>` as RoBERTa
does) and a label (any strings or integers; sorted, they become class ids and the config's
id2label; a --model whose head names them keeps its order, as run_glue); validation loss, accuracy,
macro_f1, mcc (Matthews correlation, GLUE's CoLA metric) and, with
two classes, f1 of the second label ("1" of 0/1: GLUE's MRPC / QQP F1). Numeric labels that are not all integers
(GLUE's STS-B scores), or --problem-type regression, train a regression instead: one output,
MSE loss, Pearson (the best epoch's) and Spearman correlation. The other tasks' formats and metrics are
described in tasks.py: CoNLL or JSONL word/tag files (token), SQuAD v1.1/v2.0 JSON (qa),
RACE-style JSONL (choice); every task also reads Parquet / Arrow files and datasets
save_to_disk directories in the Hub's layouts.

The model is any local HF-format RoBERTa checkpoint (ours or transformers'); the tokenizer
comes from that directory or --tokenizer. It reuses the pretraining machinery: fused backend
on a GPU (padded batches run unpadded), FusedAdam, mixed precision with loss scaling, warmup +
linear decay, atomic checkpoints with exact resume (also mid-epoch), progress and
metrics.jsonl; each epoch reports the task's validation metrics, and the best epoch (by --metric, default
the task's main one: accuracy, Pearson, entity F1, SQuAD F1; recorded in metrics.jsonl) is exported as an HF model (config.json +
model.safetensors + tokenizer) that transformers' Auto class and pipeline for the task load, and its
validation predictions to OUT/predictions/valid.* (GLUE's TSV, CoNLL, SQuAD's JSON, RACE's letters);
--predict FILE (as --valid, labels optional: a test set) adds its predictions, predict.*. --eval-only
evaluates a fine-tuned --model on --valid (metrics to OUT/eval_results.json, predictions) without training.
Defaults follow RoBERTa's GLUE recipe (10 epochs, batch 16, 6% warmup, weight decay 0.1,
Adam β2 0.98, ε 1e-6) with the peak LR sized to the model (default_lr: 2e-5 at base,
~1e-5 at large, larger for small models, printed at startup); --max-len defaults to the
model's own limit (at most 512; 384 for qa, as run_qa), --doc-stride to a third of it (run_qa's
128 of 384). --grad-accum N computes each batch as N micro-batches (the whole batch's gradients,
less memory); a step that runs out of GPU memory exits with status 1 naming it. Under torchrun
each batch is split over the processes (gradients summed: the same updates; evaluation split and
gathered; rank 0 writes and speaks: docs/finetuning.md). A run that never
beats the trivial answer says so: the majority class, the majority tag or all-O entity F1 0, the
null answer's SQuAD EM/F1, chance among the options.

SIGTERM or Ctrl-C saves a checkpoint and exits with 128 + the signal's number (143,
130); the same command then resumes, and refuses a checkpoint trained on another LR
schedule unless --allow-schedule-change. Bad input, or another run writing to --out (the
trainer's one-writer lock), exits with status 2 and one message; a full disk (checkpoint or
export) with status 1 and one message, the last checkpoint kept: the rerun exports it.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from .checkpoint import CheckpointManager, DiskSpaceError, StopSignal, load_checkpoint, restoring
from .files import absolute_if_local, write_text_atomic
from .hf import MismatchedSizes
from .integrity import is_no_space
from .metrics import MetricsLogger, wandb_missing
from .precision import DynamicLossScaler, autocast, explain, resolve_precision
from .schedule import WarmupLinearDecay
from .tasks import IGNORE, PROBLEM_TYPES, TASKS, accuracy_and_macro_f1, encode, label_names, read_examples  # noqa: F401 (re-exported)
from .tokenizer import RobertaTokenizer
from .train_config import COMMAND_LINE_ONLY
from .trainer import (Dist, Optimizer, PeerFailed, check_schedule, export_pretrained, lock_out, resolve_device, rng_state,
                      seed_everything, set_rng_state)

# the settings behind each LR-schedule field (check_schedule)
SCHEDULE_SETTINGS = {"total_steps": "steps (from --epochs, --batch-size and the number of examples)",
                     "warmup_steps": "warmup steps (--warmup-ratio)", "peak_lr": "--lr"}


@dataclass
class FinetuneConfig:
    """Every option of the fine-tuning job (each is a --flag of the CLI; its comment is the help)."""

    model: str = ""  # HF-format RoBERTa directory or Hub name to start from (required)
    train: str = ""  # training file: see --task for its format (required)
    task: str = "classify"  # classify (CSV, GLUE .tsv, JSONL) | token (CoNLL) | qa (SQuAD) | choice (RACE); also Parquet
    out: str = "runs/finetune"  # output directory: checkpoints, metrics.jsonl and the exported model/
    valid: str | None = None  # held-out file, as --train (default: a deterministic 10% of --train, held out)
    predict: str | None = None  # a file to predict, as --valid (its labels, tags or answers may be absent: GLUE's test sets): the best epoch's predictions go to OUT/predictions/predict.* (default: none)
    tokenizer: str | None = None  # tokenizer directory (default: the --model directory's)
    text_field: str = "text"  # classify: column / JSON field holding the text (column numbers from 0 read a .csv/.tsv without header: CoLA's text 3, label 1)
    pair_field: str | None = None  # classify: column / field of a second text (GLUE's .tsv: sentence2, '#2 String' (MRPC), question2 (QQP)) (default: none)
    label_field: str = "label"  # classify: column / field holding the label (any strings or integers; scores for a regression)
    problem_type: str = "auto"  # classify: auto (a regression when every label is a number and some are not integers, as GLUE's STS-B) | single_label_classification | regression
    max_len: int | None = None  # tokens per sequence with the special ones (default: the model's limit, <= 512; qa <= 384)
    doc_stride: int | None = None  # qa: tokens shared by consecutive windows (default: --max-len // 3, run_qa's 128 of 384)
    max_answer_len: int = 30  # qa: longest predicted answer, in tokens
    n_best: int = 20  # qa: start and end candidates tried per window
    null_threshold: float = 0.0  # qa, SQuAD v2.0: answer nothing when the null score beats the best span by more
    metric: str | None = None  # validation metric choosing the best epoch (exported): classify accuracy | f1 (two classes: the second label's, GLUE's MRPC / QQP) | macro_f1 | mcc (GLUE's CoLA); regression pearson | spearman; token f1 | precision | recall | accuracy (f1, precision, recall with BIO-style tags only); qa f1 | exact_match; choice accuracy (default: the first of each that the run reports: token accuracy without BIO-style tags)
    epochs: int = 10  # passes over the training examples (RoBERTa's GLUE recipe: 10)
    batch_size: int = 16  # examples per optimizer step
    grad_accum: int = 1  # split each step's batch into this many micro-batches, one forward and backward each: the same updates in less memory (RACE's batch of 16 x 4 options x 512 tokens, large models)
    lr: float | None = None  # peak learning rate (default: 2e-5 * (768 / hidden size)^2, at most 1e-3; printed)
    warmup_ratio: float = 0.06  # share of all steps spent warming up linearly to --lr
    weight_decay: float = 0.1  # decoupled (AdamW), not on biases and LayerNorm
    beta1: float = 0.9  # Adam beta1
    beta2: float = 0.98  # Adam beta2
    eps: float = 1e-6  # Adam epsilon
    clip_grad_norm: float = 0.0  # gradient norm clipping threshold (0: no clipping; the norm is still logged)
    precision: str = "auto"  # auto (bf16 on sm_80+, fp16 + loss scaling on older GPUs, fp32 on CPU) | fp32 | fp16 | bf16
    backend: str = "auto"  # model backend: auto | fused | reference
    activation_checkpointing: bool = False  # recompute each layer's activations in the backward pass: less memory, ~1/3 more compute
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0  # data order, the held-out split, the new head's weights, dropout
    log_every: int = 10  # steps between metrics.jsonl lines
    wandb_project: str | None = None  # also log to this Weights & Biases project (pip install wandb; WANDB_MODE=offline logs without an account); a resumed run goes on with its W&B run (default: none)
    stop_after: int | None = None  # stop (with a checkpoint) after this many steps (default: never); rerun to go on
    keep_checkpoints: int = 1  # checkpoints kept in OUT/checkpoints, the newest (each holds the model and Adam's state)
    resume: bool = True  # continue from the latest checkpoint in --out when there is one
    reinit_head: bool = False  # a --model whose task head has other shapes (another label count, regression) or names other labels (its id2label): start a new head (transformers' ignore_mismatched_sizes)
    allow_schedule_change: bool = False  # resume with a changed LR schedule (--lr, --epochs, --batch-size, --warmup-ratio, data)
    trust_checkpoint: bool = False  # load an old-format checkpoint that needs full unpickling (can run code: only files you wrote)
    eval_only: bool = False  # no training: evaluate --model, fine-tuned for this task (its head names the labels), on --valid and write its predictions (--predict's too); --train is not read


def default_lr(hidden_size: int) -> float:
    """Peak LR for a model of this width when --lr is not given: 2e-5 · (768 / hidden)², at most 1e-3.

    It gives the RoBERTa paper's GLUE values at its sizes (2e-5 at base, hidden 768; 1.1e-5
    at large, hidden 1024: the paper tried {1e-5, 2e-5, 3e-5}). Small models need far more:
    a 2-layer hidden-128 model stays at chance for 10 epochs at 2e-5 and 1e-4, and learns at
    3e-4 to 1e-3 (measurements in docs/training.md); the square fits both ends.
    """
    return min(1e-3, 2e-5 * (768 / hidden_size) ** 2)


# ---------------------------------------------------------------------- the job
def loss_terms(batch: dict) -> int:
    """How many terms the model's mean loss over `batch` averages: labelled tokens (token
    classification), scores (regression), else one per row (classes, options, answer spans)."""
    labels = batch.get("labels")
    if labels is None:  # qa: start and end positions, one each per window
        return len(batch["input_ids"])
    return labels.numel() if labels.is_floating_point() else int((labels != IGNORE).sum())


def micro_batches(batch: dict, n: int) -> list[dict]:
    """`batch` cut into n micro-batches of consecutive rows, as even as can be (sizes differ by at most
    one; empty ones, when the batch has fewer than n rows, are kept: each process takes its share by place)."""
    rows = len(batch["input_ids"])
    bounds = [rows * i // n for i in range(n + 1)]
    return [{k: v[start:stop] for k, v in batch.items()} for start, stop in zip(bounds, bounds[1:])]


class Finetuner:
    """Owns the model, data (a tasks.Task), optimizer and state of one fine-tuning run."""

    def __init__(self, cfg: FinetuneConfig, log=print):
        self.cfg, self.log = cfg, log
        for name in ("model", "valid") if cfg.eval_only else ("model", "train"):
            if not getattr(cfg, name):
                raise ValueError(f"--{name} is required" + (" with --eval-only" if cfg.eval_only else ""))
        if cfg.eval_only:  # the labels (or a regression) come from --valid; the model's head must fit them
            if cfg.reinit_head:
                raise ValueError("--eval-only evaluates the --model's own head: --reinit-head would make it random")
            self.cfg = cfg = dataclasses.replace(cfg, train=cfg.valid)
        self.dist = Dist()  # under torchrun: each step's batch is split over the processes
        if error := wandb_missing(cfg.wandb_project):
            raise ValueError(error)
        if cfg.task not in TASKS:
            raise ValueError(f"--task {cfg.task!r} is not one of {', '.join(TASKS)}")
        if cfg.problem_type not in PROBLEM_TYPES or (cfg.problem_type != "auto" and cfg.task != "classify"):
            raise ValueError(f"--problem-type {cfg.problem_type!r}: give one of {', '.join(PROBLEM_TYPES)}, "
                             "with --task classify only")
        if (cfg.epochs < 1 or cfg.batch_size < 1 or (cfg.max_len is not None and cfg.max_len < 4)
                or not (cfg.lr is None or cfg.lr > 0) or cfg.keep_checkpoints < 1):
            raise ValueError("need epochs >= 1, batch_size >= 1, max_len >= 4, lr > 0 and keep_checkpoints >= 1")
        world = self.dist.world_size
        if cfg.batch_size < world:
            raise ValueError(f"--batch-size {cfg.batch_size} with {world} processes: each step's examples are split "
                             f"over the processes, so give a --batch-size of at least {world}")
        if cfg.grad_accum < 1 or cfg.grad_accum * world > cfg.batch_size:
            raise ValueError(f"--grad-accum {cfg.grad_accum}" + (f" with {world} processes" if world > 1 else "")
                             + f": each step's --batch-size {cfg.batch_size} examples are split into "
                             + (f"{world} processes x " if world > 1 else "") + "--grad-accum micro-batches, so give "
                             f"--grad-accum 1 to {cfg.batch_size // world}")
        empty = [f.name for f in dataclasses.fields(cfg)
                 if isinstance(getattr(cfg, f.name), str) and not getattr(cfg, f.name).strip()]
        if empty:  # an unset shell variable (--valid "$DEV") must not quietly mean the default
            raise ValueError(f"--{empty[0].replace('_', '-')} is empty: give a value, or leave it out for its default")
        finite = ("lr", "weight_decay", "eps", "warmup_ratio", "beta1", "beta2")
        if not all(getattr(cfg, n) is None or math.isfinite(getattr(cfg, n)) for n in finite) or not (
                0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1 and cfg.eps > 0 and cfg.weight_decay >= 0
                and 0 <= cfg.warmup_ratio <= 1):
            raise ValueError(f"need finite values with 0 <= beta1, beta2 < 1, eps > 0, weight_decay >= 0 and "
                             f"0 <= warmup_ratio <= 1; got lr {cfg.lr}, beta1 {cfg.beta1}, beta2 {cfg.beta2}, "
                             f"eps {cfg.eps}, weight_decay {cfg.weight_decay}, warmup_ratio {cfg.warmup_ratio}")
        if cfg.n_best < 1 or cfg.max_answer_len < 1:
            raise ValueError(f"need --n-best >= 1 and --max-answer-len >= 1 (got {cfg.n_best} and "
                             f"{cfg.max_answer_len}): with none, every predicted answer would be empty")
        self.out = Path(cfg.out)
        self.device = resolve_device(cfg.device, self.dist.local_rank)
        self.dist.init(self.device)
        try:
            self._build()
        except BaseException:  # leave the process group: a rank exiting inside it can abort (gloo)
            self.dist.close()
            raise

    def _build(self) -> None:
        """The tokenizer, data, model, optimizer and run state, once the process group is joined."""
        cfg, log = self.cfg, self.log
        if not self.dist.is_main:  # rank 0 speaks for the job; the others compute alike
            self.log = log = (lambda *a, **k: None)
        self.precision = resolve_precision(cfg.precision, self.device)
        seed_everything(cfg.seed)  # the same on every rank: held-out split, data order, a new head's weights

        self.tokenizer = RobertaTokenizer.from_pretrained(cfg.tokenizer or cfg.model)
        self.task = task = TASKS[cfg.task](cfg)
        self.names = task.names
        if cfg.metric is not None:
            if cfg.metric not in task.metrics:
                raise ValueError(f"--metric {cfg.metric!r}: this run (--task {cfg.task}, {task.describe()}) reports "
                                 f"{', '.join(task.metrics)}; give one of them")
            task.best_metric = cfg.metric
        for note in task.notes:
            log(f"note: {note}")
        with warnings.catch_warnings(record=True) as caught:  # a new head is expected: say it once, briefly
            warnings.simplefilter("always")
            try:
                self.model, loaded = task.model_class.from_pretrained(cfg.model, backend=cfg.backend,
                                                                      ignore_mismatched_sizes=cfg.reinit_head,
                                                                      output_loading_info=True, **task.model_kwargs())
            except MismatchedSizes as err:  # a fine-tuned model's head, another label set: say the CLI's fix
                fix = ("--eval-only needs a model fine-tuned on these labels" if cfg.eval_only else
                       "pass --reinit-head to start a new head, or fine-tune from the pretrained model")
                raise ValueError(f"--model {cfg.model}'s task head does not fit this task ({task.describe()}): "
                                 f"{err.detail}; {fix}") from None
        new = sorted({*loaded["missing_keys"], *(key for key, *_ in loaded["mismatched_keys"])})
        if cfg.eval_only and any(not key.startswith("roberta.") for key in new):
            raise ValueError(f"--eval-only evaluates a fine-tuned --model, and {cfg.model} has no head for --task "
                             f"{cfg.task}: {', '.join(k for k in new if not k.startswith('roberta.'))} would be "
                             "random; fine-tune it first (without --eval-only)")
        for w in caught:
            log(f"note: {w.message}")
        self.follow_head_labels({*loaded["missing_keys"], *(key for key, *_ in loaded["mismatched_keys"])})
        if cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable()
        limit = self.model.config.max_seq_len
        if cfg.max_len is not None and cfg.max_len > limit:
            raise ValueError(f"--max-len {cfg.max_len} exceeds the model's {limit} positions; "
                             f"use --max-len {limit} or less (or leave it out: the model's limit is the default)")
        self.max_len = cfg.max_len or min(limit, task.max_len)
        task.encode(self.tokenizer, self.max_len)
        self.predict_task = task.for_predictions(cfg.predict, self.tokenizer, self.max_len) if cfg.predict else None
        if getattr(task, "truncated", 0):
            log(f"note: {task.truncated} sentences are longer than --max-len {self.max_len} tokens: "
                "their words past it are not trained on or scored; raise --max-len to keep them")
        self.model.config.extra.update(task.config_extra())
        self.model.to(self.device)
        self.ddp = None
        if self.dist.enabled:  # starts every rank from rank 0's weights; sums gradients during the backward
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(  # (no buffers to broadcast: ranks run unequal forward counts)
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True, broadcast_buffers=False)
        if self.dist.rank:  # dropout streams differ per rank; rank 0 keeps the single-process stream
            seed_everything(cfg.seed + 1_000_003 * self.dist.rank)
        self.model.check_inputs = False  # ids come from the model's own tokenizer, lengths are truncated
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ValueError(f"the tokenizer has {self.tokenizer.vocab_size} ids but the model "
                             f"{self.model.config.vocab_size}: pass the model's own tokenizer")
        self.pad_id = self.model.config.pad_token_id
        if cfg.lr is None:  # sized to the model; the resolved value is what the checkpoint records
            hidden = self.model.config.hidden_size
            self.cfg = cfg = dataclasses.replace(cfg, lr=default_lr(hidden))
            if not cfg.eval_only:
                log(f"--lr not given: {cfg.lr:.3g} for hidden size {hidden} (2e-5 * (768 / {hidden})^2, "
                    "at most 1e-3; pass --lr to choose)")

        self.steps_per_epoch = math.ceil(len(task) / cfg.batch_size)
        total = self.steps_per_epoch * cfg.epochs
        self.schedule = WarmupLinearDecay(cfg.lr, round(cfg.warmup_ratio * total), total)
        self.optimizer = Optimizer(self.model, cfg)  # reads lr, betas, eps, weight_decay, clip_grad_norm
        self.scaler = DynamicLossScaler(enabled=self.precision == "fp16")
        self.checkpoints = CheckpointManager(self.out / "checkpoints", keep=cfg.keep_checkpoints)
        self.step, self.best = 0, None
        self.epochs_evaluated = 0  # a stop on an epoch's last step leaves its evaluation to the resumed run
        self.export_pending = False  # the best epoch's export is not written yet (a full disk stopped it)
        # one writer per --out, as the trainer (last: nothing can fail after); rank 0 writes for the job, and
        # if it cannot take the lock every rank stops
        self.lock = self.dist.main_does(lambda: lock_out(self.out, log))


    def follow_head_labels(self, new_weights: set) -> None:
        """A --model whose head came with the checkpoint (no weight of it in `new_weights`) keeps its label
        order (its rows mean its config's id2label classes: Task.follow_head_labels). A head that names
        other labels than the data's, though it fits in shape, is refused: its rows would silently mean
        other classes; --reinit-head starts a new one."""
        id2label = self.model.config.id2label
        if any(key.startswith("classifier.") for key in new_weights) or self.task.follow_head_labels(id2label):
            self.names = self.task.names
            return
        head = [id2label[i] for i in sorted(id2label)]
        if not self.cfg.reinit_head:
            fix = ("Name the labels in the data as the model does" if self.cfg.eval_only else
                   "Pass --reinit-head to start a new head, or name the labels in the data as the model does")
            raise ValueError(f"--model {self.cfg.model}'s task head was trained on the labels {head} (its "
                             f"config.json's id2label), this data has {self.task.names}: the head's outputs would "
                             f"mean other classes. {fix}")
        self.model.classifier.apply(self.model._init_weights)
        self.log(f"note: --reinit-head: a new head for {self.task.names} (the --model's was trained on {head})")

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.task))

    def state_dict(self) -> dict:
        """The run's state; collective (every rank contributes its RNG state)."""
        rngs = self.dist.gather_objects(rng_state(self.device))
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "schedule": self.schedule.state_dict(), "scaler": self.scaler.state_dict(),
                "step": self.step, "best": self.best, "best_metric": self.task.best_metric,
                "epochs_evaluated": self.epochs_evaluated,
                "export_pending": self.export_pending,
                "rng": rngs[0], "rngs": rngs,  # rank 0's (what a single process reads), every rank's
                "labels": self.names, "task": self.cfg.task,
                "tokenizer_hash": self.tokenizer.tokenizer_hash,  # roberta_fast.export refuses another tokenizer
                "config": {k: absolute_if_local(v) if k in ("model", "tokenizer") else v  # export reads them anywhere
                           for k, v in dataclasses.asdict(self.cfg).items() if k not in COMMAND_LINE_ONLY},
                "model_config": self.model.config.to_dict()}  # python -m roberta_fast.export rebuilds from it

    def load_state_dict(self, state: dict) -> None:
        task = state.get("task", "classify")
        if task != self.cfg.task:
            raise ValueError(f"the checkpoint in {self.out} is of --task {task}, this run is --task "
                             f"{self.cfg.task}: use another --out")
        if state["labels"] != self.names:
            def labels(names):
                return names or "scores (a regression)"
            raise ValueError(f"the checkpoint in {self.out} was trained on labels {labels(state['labels'])}, "
                             f"this data has {labels(self.names)}: use another --out")
        if state["step"] > self.schedule.total_steps:
            raise ValueError(f"the checkpoint in {self.out} is at step {state['step']}, past this run's "
                             f"{self.schedule.total_steps} steps: use another --out")
        # the best epoch so far was chosen (and exported) by the run's metric; the weights of the epoch another
        # metric would choose are gone (older checkpoints record it only when --metric was given)
        chosen_by = state.get("best_metric") or state["config"].get("metric")
        if state["best"] is not None and chosen_by is not None and chosen_by != self.task.best_metric:
            raise ValueError(f"the run in {self.out} chose its best epoch so far by {chosen_by}, this run asks for "
                             f"--metric {self.task.best_metric}: the best epoch by {self.task.best_metric} among those "
                             f"already evaluated was not kept. Resume with --metric {chosen_by}, or use another --out")
        check_schedule(state["schedule"], self.schedule, SCHEDULE_SETTINGS, self.cfg.allow_schedule_change, self.log)
        self.model.load_state_dict(state["model"])
        changed = self.optimizer.load_state_dict(state["optimizer"])  # this run's --weight-decay, betas, eps
        if changed:
            self.log(f"note: the optimizer goes on with this run's settings, not the checkpoint's: {', '.join(changed)}")
        self.schedule.load_state_dict(state["schedule"])
        self.scaler.load_state_dict(state["scaler"])
        self.step, self.best = state["step"], state["best"]
        # older checkpoints: assume all but the last finished epoch evaluated (evaluating one again is harmless)
        self.epochs_evaluated = state.get("epochs_evaluated", max(0, self.step // self.steps_per_epoch - 1))
        self.export_pending = state.get("export_pending", False)
        rngs = state.get("rngs", [state["rng"]])
        if len(rngs) == self.dist.world_size:
            set_rng_state(rngs[self.dist.rank], self.device)
        else:  # another number of processes: the dropout streams cannot continue; start fresh ones
            self.log(f"note: the checkpoint was written by {len(rngs)} processes, this run has "
                     f"{self.dist.world_size}: dropout RNG streams are reseeded")
            seed_everything(self.cfg.seed + 1_000_003 * self.dist.rank + self.step)

    def train_step(self, batch: dict) -> tuple[float, float, bool]:
        """One optimizer step on `batch`, in --grad-accum micro-batches per process: each one's mean loss
        weighted by its share of the batch's loss terms, so the gradients (summed over the processes) are
        the whole batch's. Every process reads the same batches and takes its own micro-batches; under
        torchrun DDP sums the gradients in buckets during the last one's backward."""
        self.model.train()
        accum, rank, world = self.cfg.grad_accum, self.dist.rank, self.dist.world_size
        terms = loss_terms(batch)
        split = micro_batches(batch, accum * world)
        # a micro-batch without rows or labelled tokens has nothing to learn (its mean loss would be NaN)
        mine = [(micro, count / terms) for micro in split[rank * accum:(rank + 1) * accum]
                if (count := loss_terms(micro))]
        if self.ddp is not None and terms and not mine:
            # every process joins DDP's gradient sum once a step: this one, without a row of its own, adds
            # zeros (another process's first micro-batch, its loss times 0)
            mine = [(next(micro for micro in split if loss_terms(micro)), 0.0)]
        loss = torch.zeros((), device=self.device)
        for i, (micro, share) in enumerate(mine):
            last = i == len(mine) - 1
            sync = contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync()
            with sync:
                with autocast(self.precision, self.device):
                    micro_loss = (self.ddp or self.model)(**{k: v.to(self.device) for k, v in micro.items()}).loss
                    micro_loss = micro_loss * share
                (micro_loss * (self.scaler.scale * world)).backward()  # DDP averages: x world_size
            loss += micro_loss.detach().float()
        if self.dist.enabled:
            self.dist.all_reduce(loss)
        norm, skipped = self.optimizer.step(self.schedule.lr(), self.scaler.scale)
        self.optimizer.zero_grad()
        self.scaler.update(skipped)
        if not skipped:
            self.schedule.step()
        return float(loss), norm, skipped

    @torch.no_grad()
    def evaluate(self, task=None) -> dict:
        """The task's validation metrics (loss first) at the current weights, its predictions kept for
        write_predictions (`task`: another, predict_task). Under torchrun each process runs every
        world_size-th batch; all gather the outputs and compute the same metrics."""
        task = task or self.task
        self.model.eval()

        def run(batch):
            with autocast(self.precision, self.device):
                return self.model(**{k: v.to(self.device) for k, v in batch.items()})

        if not self.dist.enabled:
            return task.evaluate(run, self.cfg.batch_size, self.pad_id)
        world, rank = self.dist.world_size, self.dist.rank
        mine = {i: {k: v.cpu() for k, v in run(batch).items()}
                for i, batch in enumerate(task.valid_batches(self.cfg.batch_size, self.pad_id))
                if i % world == rank}
        outputs = {i: SimpleNamespace(**out) for part in self.dist.gather_objects(mine) for i, out in part.items()}
        replay = iter(outputs[i] for i in range(len(outputs)))
        return task.evaluate(lambda batch: next(replay), self.cfg.batch_size, self.pad_id)

    def export(self) -> None:
        """The best epoch's model in HF format, OUT/model, and its predictions, OUT/predictions/valid.* and
        (--predict) predict.* (rank 0 writes them; the others wait). It follows that epoch's checkpoint
        (export_pending set), so a full disk here keeps the checkpoint and the rerun exports without
        training again."""
        if self.task.predictions is None:  # a resumed run's pending export: that epoch's, evaluated again
            self.evaluate()
        def export_model():
            try:
                export_pretrained(self.model, self.tokenizer, self.out / "model")
            except DiskSpaceError as err:
                raise DiskSpaceError(f"{err}. The checkpoint of step {self.step} is kept: the rerun exports the "
                                     "best epoch without training again") from None
            self.task.after_export(self.out / "model")

        self.dist.main_does(export_model)
        self.write_predictions("the best epoch's predictions", f". The checkpoint of step {self.step} is kept: the "
                               "rerun exports the best epoch without training again")
        self.export_pending = False

    def write_predictions(self, what: str, then: str = "") -> None:
        """OUT/predictions/valid.* from the last evaluation and, with --predict, predict.* (evaluated now);
        collective (rank 0 writes them). A full disk: DiskSpaceError naming `what`, then saying `then`."""
        if self.predict_task is not None:
            self.evaluate(self.predict_task)

        def write():
            self.task.write_predictions(self.out / "predictions" / "valid")
            if self.predict_task is not None:
                self.predict_task.write_predictions(self.out / "predictions" / "predict")

        self.main_writes(write, what, then)

    def main_writes(self, write, what: str, then: str = "") -> None:
        """write() on rank 0 (Dist.main_does), a full disk there one DiskSpaceError naming `what`."""
        def guarded():
            try:
                write()
            except OSError as err:
                if not is_no_space(err):
                    raise
                raise DiskSpaceError(f"no space left on the disk of {str(self.out)!r} (writing {what}){then}") from None

        self.dist.main_does(guarded)

    def evaluate_only(self) -> dict:
        """--eval-only: --model's validation metrics, printed and in OUT/eval_results.json (as run_glue's; a
        training run's metrics.jsonl in --out is left as it is), and its predictions."""
        result = self.evaluate()
        self.write_predictions("the predictions")
        record = {"model": absolute_if_local(self.cfg.model), "valid": absolute_if_local(self.cfg.valid), **result}
        self.main_writes(lambda: write_text_atomic(self.out / "eval_results.json", json.dumps(record, indent=1) + "\n"),
                         "eval_results.json")
        self.log(f"--model {self.cfg.model} on {self.cfg.valid} ({len(self.task.valid)} examples): " +
                 ", ".join(f"{k} {v:.4f}" for k, v in result.items()) + f"; predictions in {self.out / 'predictions'}")
        return {"best": None, "last": result, "metric": self.task.best_metric}

    def save_checkpoint(self) -> None:
        """A checkpoint of the run; collective (rank 0 writes it, the others wait; a full disk stops every rank)."""
        state = self.state_dict()
        self.dist.main_does(lambda: self.checkpoints.save(self.step, state))

    def close(self) -> None:
        """Release --out and leave the process group."""
        if self.lock is not None:
            self.lock.release()
        self.dist.close()

    def end_epoch(self, epoch: int, metrics: MetricsLogger) -> dict:
        """Evaluate the epoch just finished, checkpoint, and export it if it is the best so far."""
        result = self.evaluate()
        key = self.task.best_metric  # (the same as the run's before a resume: load_state_dict checks)
        if self.best is None or result[key] > self.best.get(key, -math.inf):
            self.best = {"epoch": epoch + 1, **result}
            self.export_pending = True
        metrics.log({"kind": "eval", "step": self.step, "epoch": epoch + 1, **result,
                     "best_metric": key, "best_epoch": self.best["epoch"]})
        metrics.write(f"epoch {epoch + 1}: valid " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
        self.epochs_evaluated = epoch + 1
        self.save_checkpoint()
        if self.export_pending:
            self.export()
        return result

    def run(self) -> dict:
        if self.cfg.eval_only:
            return self.evaluate_only()
        latest = self.checkpoints.latest() if self.cfg.resume else None
        if latest is not None:
            # onto the CPU: the RNG states must stay CPU tensors; load_state_dict moves the rest
            state = load_checkpoint(latest, trust=self.cfg.trust_checkpoint)
            with restoring(latest):
                self.load_state_dict(state)
            self.log(f"resumed from {latest} at step {self.step}")
            if self.export_pending:  # its best epoch was never exported (the disk was full)
                self.export()
        total = self.steps_per_epoch * self.cfg.epochs
        self.log(f"fine-tuning --task {self.cfg.task} on {len(self.task)} training {self.task.unit} "
                 f"({len(self.task.valid)} held-out examples), {self.task.describe()}, {total} steps, "
                 f"{self.precision} on {self.device} ({explain(self.cfg.precision, self.device)})")
        # after the line: it opens the bar
        metrics = MetricsLogger(self.out, total, start_step=self.step, enabled=self.dist.is_main,
                                wandb_project=self.cfg.wandb_project, run_config=dataclasses.asdict(self.cfg))
        result = None
        try:
            with StopSignal() as stop:
                finished = self.step // self.steps_per_epoch
                if finished > self.epochs_evaluated:  # stopped on an epoch's last step: evaluate it now
                    result = self.end_epoch(finished - 1, metrics)
                while self.step < total:
                    epoch, position = divmod(self.step, self.steps_per_epoch)
                    order = self.order(epoch)[position * self.cfg.batch_size:]
                    for batch in self.task.batches(order, self.cfg.batch_size, self.pad_id):
                        loss, norm, skipped = self.train_step(batch)
                        self.step += 1
                        metrics.advance(self.step)
                        if self.step % self.cfg.log_every == 0:
                            metrics.log({"kind": "train", "step": self.step, "loss": loss, "lr": self.schedule.lr(),
                                         "grad_norm": norm, "skipped": skipped, "loss_scale": self.scaler.scale})
                        stopped_by = self.dist.agreed_signal(stop)  # every rank stops at the same step
                        reason = (stopped_by and stopped_by.name) or (self.step == self.cfg.stop_after
                                                                      and "--stop-after")
                        if reason:
                            self.save_checkpoint()
                            self.log(f"{reason}: checkpoint saved at step {self.step}; rerun to resume")
                            self.dist.barrier()  # leave together (a rank gloo tears down under a peer aborts)
                            return {"stopped": reason, "step": self.step, "signal": stopped_by}
                    result = self.end_epoch(epoch, metrics)
        except BaseException:
            metrics.close(failed=True)
            raise
        finally:
            metrics.close()
        self.log(f"best epoch {self.best['epoch']} (by {self.task.best_metric}): " + ", ".join(
            f"{k} {v:.4f}" for k, v in self.best.items() if k not in ("epoch", "loss")) +
            f"; exported to {self.out / 'model'}")
        warning = self.task.baseline_warning(self.best)
        if warning:
            self.log(f"warning: {warning}. Try a larger --lr (this run: {self.cfg.lr:.3g}), "
                     "more --epochs, more data or a better-pretrained model")
        self.dist.barrier()  # leave together (a rank gloo tears down under a peer aborts)
        return {"best": self.best, "last": result, "metric": self.task.best_metric}


def build_parser() -> argparse.ArgumentParser:
    """The CLI: one flag per FinetuneConfig field, its comment as the help."""
    from .train_config import field_help

    parser = argparse.ArgumentParser(prog="python -m roberta_fast.finetune",
                                     description=__doc__.split("\n\n")[0])
    helps = field_help(FinetuneConfig)
    for f in dataclasses.fields(FinetuneConfig):
        flag = "--" + f.name.replace("_", "-")
        required = f.name == "model"  # and --train, unless --eval-only (Finetuner says so)
        text = helps.get(f.name, "")
        if not required and f.default is not None:  # a None default is described by the help itself
            text += f" (default {f.default})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        else:
            kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
            choices = {"task": list(TASKS), "problem_type": list(PROBLEM_TYPES)}.get(f.name)
            parser.add_argument(flag, type=kind, default=f.default, required=required, choices=choices,
                                metavar=kind.__name__.upper(), help=text)
    return parser


def out_of_memory_advice(cfg: FinetuneConfig, world_size: int = 1) -> str:
    """What to change when a step does not fit in the GPU's memory: more micro-batches per step (the
    same updates; the rerun resumes from the last checkpoint), activation checkpointing, shorter windows."""
    ways, most = [], cfg.batch_size // world_size
    if cfg.grad_accum < most:
        ways.append(f"--grad-accum {min(most, 2 * cfg.grad_accum)} (the same updates, in micro-batches of "
                    "fewer examples; the rerun resumes from the last checkpoint)")
    if not cfg.activation_checkpointing:
        ways.append("--activation-checkpointing (less activation memory, about a third more compute)")
    ways.append("a smaller --max-len")
    micro = -(-cfg.batch_size // (cfg.grad_accum * world_size))
    return f"A micro-batch of {micro} examples does not fit in memory: rerun with {', or '.join(ways)}."


def main(argv=None) -> int:
    """The CLI; under torchrun a mistake every rank makes (the data, the flags) is reported once, by rank 0."""
    from .train import report
    from .train_config import parse_args_once

    cfg = FinetuneConfig(**vars(parse_args_once(build_parser(), argv)))
    prefix, world = "roberta_fast.finetune: error", int(os.environ.get("WORLD_SIZE", "1"))
    finetuner = None
    try:
        finetuner = Finetuner(cfg)
        result = finetuner.run()
    except (ValueError, FileNotFoundError) as err:
        report(err, every_rank=False, prefix=prefix)
        return 2
    except PeerFailed as err:  # another process failed and said why; rank 0 adds a line if it is a survivor
        report(err, every_rank=False, prefix=prefix)
        return 1
    except DiskSpaceError as err:  # a checkpoint or the export (rank 0's): the last checkpoint is kept
        report(err, every_rank=False, prefix=prefix)
        return 1
    except torch.OutOfMemoryError as err:  # name the flags that fit a step in memory
        report(RuntimeError(f"{str(err).strip()} {out_of_memory_advice(cfg, world)}"), every_rank=True, prefix=prefix)
        return 1
    finally:
        if finetuner is not None:
            finetuner.close()
    # stopped by SIGTERM / SIGINT (checkpoint saved): 128 + the signal's number, as a shell reports it
    return 128 + result["signal"] if result.get("signal") else 0


if __name__ == "__main__":
    sys.exit(main())
