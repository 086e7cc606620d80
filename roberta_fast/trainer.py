"""The RoBERTa pretraining loop: one Trainer owns the model, optimizer, data and state.

    trainer = Trainer(TrainConfig.preset("tiny"))
    trainer.run()          # train to max_steps, evaluating, logging, checkpointing, exporting

One optimizer step (`train_step`): `grad_accum` micro-batches are taken from the
loader, masked on the device (`mask_tokens`, seeded by (seed, step, global sample
index), so a mask does not depend on how the batch is split), their predicted tokens
counted and all-reduced over ranks; each micro-batch runs the MLM head only on its
predicted positions with a summed loss scaled by world_size · loss_scale / total
predicted tokens (DDP averages over ranks), so the update equals one big batch's;
`no_sync` skips the gradient all-reduce on all but the last micro-batch. The optimizer
unscales, clips and applies AdamW with the scheduled LR, or skips the step when a
gradient is not finite (the scaler halves, the schedule does not advance).

Data parallel: started by torchrun (WORLD_SIZE > 1), NCCL on GPUs, gloo on CPU; each
rank reads its own part of every global batch (BatchLoader(rank, world_size)).

Resume is exact: a checkpoint holds the model, optimizer, schedule, loss scaler, loader
position, step and every rank's RNG states; on CPU in fp32 a resumed run's losses equal
an uninterrupted run's bit for bit (tests/test_train.py).

Measured: the default run (tiny preset, 300 steps of 16 x 128 tokens, embedded corpus
built from scratch) takes 50 s on 2 CPU cores (~23k tokens/s, reference backend, fp32),
validation MLM loss 9.00 -> 6.51. Not yet measured on a GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from . import ops
from .checkpoint import (CheckpointManager, DamagedCheckpoint, DiskSpaceError, RunLock, StopSignal, load_checkpoint,
                         restoring)
from .config import RobertaConfig
from .files import absolute_if_local
from .hf import WEIGHT_SHARD
from .hub import model_dir, tokenizer_dir
from .integrity import is_no_space
from .metrics import MetricsLogger, memory_gb, plot_losses, read_metrics
from .model import IGNORE_INDEX, RobertaForMaskedLM, estimate_mfu
from .sbo import RobertaForSpanBERT
from .precision import DynamicLossScaler, autocast, explain, resolve_precision
from .schedule import WarmupLinearDecay
from .train_config import TrainConfig

# the TrainConfig setting behind each LR-schedule field (check_schedule)
SCHEDULE_SETTINGS = {"total_steps": "--max-steps", "warmup_steps": "--warmup-steps", "peak_lr": "--lr",
                     "min_lr": "--min-lr"}
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")  # TrainConfig's
EVAL_MASK_SEED = 0xE7A1  # validation masks are fixed, and the same for every run and world size


# ---------------------------------------------------------------------- distributed
class PeerFailed(RuntimeError):
    """Another process of the torchrun job failed: a collective broke off, or rank 0 said that its part
    (the --out lock, a checkpoint, the export) failed. That process's own error says why."""


class Dist:
    """This process's place in a torchrun job (world_size 1 without torchrun)."""

    def __init__(self):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.enabled = self.world_size > 1
        self.device = None
        self.failed_together = False  # main_does failed: every rank stops, and knows it

    def init(self, device: torch.device) -> None:
        """Join the process group: NCCL for GPUs, gloo for CPUs."""
        self.device = device
        if self.enabled and not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.enabled:
            self._collective(dist.all_reduce, tensor, op=op)
        return tensor

    def main_does(self, work):
        """work() on rank 0 while the others wait; returns its result there (None elsewhere). If it raises,
        rank 0 raises that and every other rank PeerFailed, so that none goes on alone (a lock another run
        holds, a full disk at a checkpoint) into a collective that rank 0 never reaches."""
        result = error = None
        if self.is_main:
            try:
                result = work()
            except Exception as err:  # noqa: BLE001 -- re-raised below, after the others know
                error = err
        if self.enabled:
            failed = torch.tensor([float(error is not None)], device=self.device)
            self.failed_together = bool(self.all_reduce(failed, dist.ReduceOp.MAX).item())
            if self.failed_together and error is None:
                raise PeerFailed("rank 0 stopped (its error says why)")
        if error is not None:
            raise error
        return result

    def _collective(self, collective, *args, **kwargs):
        try:
            return collective(*args, **kwargs)
        except RuntimeError as err:  # gloo: "Connection closed by peer"; NCCL: DistBackendError
            first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
            raise PeerFailed(f"another process of this torchrun job stopped (its error says why): {first}") from None

    def agreed_signal(self, stop) -> signal.Signals | None:
        """The SIGTERM/SIGINT any rank's StopSignal got, or None: all ranks must stop at the same step."""
        number = signal.Signals[stop.requested].value if stop.requested else 0
        if self.enabled:  # only then a device tensor: its copy syncs with the GPU every step
            flag = torch.tensor([float(number)], device=self.device)
            number = int(self.all_reduce(flag, dist.ReduceOp.MAX).item())
        return signal.Signals(number) if number else None

    def gather_objects(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        self._collective(dist.all_gather_object, out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            # NCCL: name this rank's GPU; a barrier before any other collective would
            # otherwise run on GPU rank % device_count (torch 2.4-2.x), maybe not ours
            if self.device is not None and self.device.type == "cuda" and dist.get_backend() == "nccl":
                self._collective(dist.barrier, device_ids=[self.device.index])
            else:
                self._collective(dist.barrier)

    def close(self) -> None:
        """Leave the process group; after main_does failed, together (every rank is closing then): a process
        that tears gloo down while a peer still uses its connections can abort the peer (SIGABRT, "terminate
        called without an active exception"). Not after a failure of this rank alone (its peers are in
        another collective, which a barrier here would be taken for)."""
        if self.enabled and dist.is_initialized():
            if self.failed_together:
                try:
                    self.barrier()
                except PeerFailed:  # a peer is gone already: nothing to wait for
                    pass
            dist.destroy_process_group()


def resolve_device(name: str, local_rank: int) -> torch.device:
    """The torch.device for --device ("auto": this rank's GPU if there is one, else the CPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device cuda was asked for but no CUDA GPU is available; use --device cpu")
        if device.index is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(f"--device {name} under torchrun would put every process on GPU {device.index}; use "
                             "--device cuda (each process takes its LOCAL_RANK's GPU), or CUDA_VISIBLE_DEVICES to "
                             "choose the GPUs")
        if device.index is None:
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        check_torch_runs_on(torch.cuda.get_device_capability(device), torch.cuda.get_arch_list(),
                            torch.cuda.get_device_name(device))
    elif device.type != "cpu":
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    return device


def check_torch_runs_on(capability: tuple[int, int], arch_list: list[str], gpu_name: str) -> None:
    """Refuse, before any work, a GPU this torch build has no kernels for: torch only warns and
    then fails at the first kernel with "no kernel image is available". The case users meet: a V100
    (sm_70) under torch >= 2.11's CUDA 12.8 / 13 wheels, which dropped Volta (the CUDA 12.6 ones
    keep it). Rules as torch's own check: an sm_XY binary runs on the same major version and a
    minor at least Y; compute_XY (PTX) on any capability at least X.Y."""
    if not arch_list:  # a build that lists nothing (ROCm): nothing to check against
        return
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        digits = "".join(c for c in number if c.isdigit())  # "sm_90a" -> "90"
        if len(digits) < 2:
            continue
        built = (int(digits[:-1]), int(digits[-1]))
        if (kind == "sm" and built[0] == capability[0] and built[1] <= capability[1]) or \
                (kind == "compute" and built <= capability):
            return
    sm = f"sm_{capability[0]}{capability[1]}"
    fix = ("install torch's CUDA 12.6 build (pip install torch --index-url "
           "https://download.pytorch.org/whl/cu126), which keeps sm_70 and older, and rebuild roberta_fast "
           "with a CUDA 12 nvcc (README, Install)" if capability < (7, 5) else
           "install a torch build that lists it (https://pytorch.org/get-started/locally/)")
    raise ValueError(f"{gpu_name} ({sm}) has no kernels in this torch build ({torch.__version__}, built for "
                       f"{' '.join(arch_list)}); {fix}, or use --device cpu")


# ---------------------------------------------------------------------- optimizer
class Optimizer:
    """FusedAdam behind one call: unscale, measure the gradient norm, clip, step or skip.

    Weight decay on matrices and embeddings only (param_groups_for_weight_decay).
    `step(lr, scale)` returns (gradient norm before clipping, whether the gradients
    were non-finite and the step was skipped); reading the norm is the step's one sync.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig):
        from .optim import FusedAdam, param_groups_for_weight_decay

        # clip_grad_norm 0 (no clipping): an infinite threshold still measures the norm
        self.clip = cfg.clip_grad_norm if cfg.clip_grad_norm > 0 else math.inf
        self.opt = FusedAdam(param_groups_for_weight_decay(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)

    def step(self, lr: float, scale: float) -> tuple[float, bool]:
        for group in self.opt.param_groups:
            group["lr"] = lr
        norm = self.opt.clip_grad_norm_(self.clip, grad_scale=scale)
        self.opt.step(grad_scale=scale)  # skipped on the device when the norm is not finite
        norm = float(norm)
        return norm, not math.isfinite(norm)

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> list[str]:
        """Load the saved moments and step, keeping this run's weight decay, betas and eps (the
        saved groups' values would win, so a resume with changed flags would train with the old
        ones while the run's config records the new); returns the changes, e.g. "--eps 1e-06 -> 1e-08"."""
        mine = [{k: g[k] for k in ("weight_decay", "betas", "eps")} for g in self.opt.param_groups]
        self.opt.load_state_dict(state)
        changed = []
        for group, keep in zip(self.opt.param_groups, mine):  # the no-decay group keeps its 0
            saved = {k: group[k] for k in keep}
            group.update(keep)
            for flag, a, b in [("--weight-decay", saved["weight_decay"], keep["weight_decay"]),
                               ("--beta1", saved["betas"][0], keep["betas"][0]),
                               ("--beta2", saved["betas"][1], keep["betas"][1]), ("--eps", saved["eps"], keep["eps"])]:
                if a != b and f"{flag} {a} -> {b}" not in changed:
                    changed.append(f"{flag} {a} -> {b}")
        return changed


# ---------------------------------------------------------------------- resume
def check_schedule(saved: dict, schedule: WarmupLinearDecay, settings: dict[str, str], allow: bool, log) -> None:
    """Refuse to resume a checkpoint onto another LR schedule than the one it was trained on.

    A new schedule mid-run makes the LR jump (e.g. a longer --max-steps moves the whole decay
    back up) with no one having asked for it. `saved` is the checkpoint's schedule state;
    `settings` names the setting behind each schedule field compared. With `allow`
    (--allow-schedule-change) the run goes on, saying so in one line."""
    changed = [(settings[k], saved[k], getattr(schedule, k)) for k in settings
               if k in saved and saved[k] != getattr(schedule, k)]
    if not changed:
        return
    update = int(saved["num_updates"])
    old = WarmupLinearDecay(saved["peak_lr"], saved["warmup_steps"], saved["total_steps"], saved["min_lr"])
    what = ", ".join(f"{name} {a} -> {b}" for name, a, b in changed)
    first = next((u for u in range(update, max(old.total_steps, schedule.total_steps) + 1)
                  if not math.isclose(old.lr_at(u), schedule.lr_at(u), rel_tol=1e-9)), update)
    jump = f"the LR of update {first} goes from {old.lr_at(first):.3g} to {schedule.lr_at(first):.3g}"
    if first > update:  # e.g. inside a warmup both schedules share
        jump = f"the LR is unchanged until update {first}, where it goes from {old.lr_at(first):.3g} to " \
               f"{schedule.lr_at(first):.3g}"
    if not allow:
        raise ValueError(f"the checkpoint was trained on another LR schedule ({what}): resuming would start a "
                         f"new schedule mid-run ({jump}). Resume with the checkpoint's settings, use a new --out, "
                         "or pass --allow-schedule-change to continue on the new schedule")
    log(f"note: --allow-schedule-change: continuing on a new LR schedule ({what}); {jump}")


# ---------------------------------------------------------------------- rng
def rng_state(device: torch.device) -> dict:
    """Every RNG this process draws from (dropout: torch's CPU and CUDA generators), as
    tensors, numbers and tuples only, so a checkpoint holding it loads with weights_only=True."""
    numpy_state = np.random.get_state(legacy=False)  # {"bit_generator", "state": {"key", "pos"}, ...}
    numpy_state["state"] = {"key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                            "pos": int(numpy_state["state"]["pos"])}
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore what rng_state() returned (its tensors may have been loaded onto any device).

    Also takes the legacy NumPy tuple of checkpoints from older versions (--trust-checkpoint)."""
    torch.set_rng_state(state["torch"].cpu())  # generator states must be CPU ByteTensors
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = {**numpy_state, "state": {"key": numpy_state["state"]["key"].cpu().numpy().astype(np.uint32),
                                                "pos": numpy_state["state"]["pos"]}}
    np.random.set_state(numpy_state)
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------- metrics
def attended_pairs(batch: dict) -> int:
    """The (query, key) pairs attention computes for a host batch, for MFU: each sequence's length
    squared (a packed row's documents each on their own), padding none."""
    mask = batch["attention_mask"]
    if "cu_seqlens" not in batch:
        return int((mask.sum(1) ** 2).sum())
    cu = batch["cu_seqlens"].long()
    real = mask.reshape(-1)[cu[:-1]] != 0  # a row's padding tail is a segment of its own
    return int((cu.diff()[real] ** 2).sum())


# ---------------------------------------------------------------------- trainer
class Trainer:
    """Everything of one training run; `run()` trains, `train_step()` does one optimizer step."""

    def __init__(self, cfg: TrainConfig, log=print):
        self.cfg = cfg.validate()
        self.dist = Dist()
        self.device = resolve_device(cfg.device, self.dist.local_rank)
        self.dist.init(self.device)
        self.print = log if self.dist.is_main else (lambda *a, **k: None)
        self.precision = resolve_precision(cfg.precision, self.device)
        self.grad_accum, self.global_batch = cfg.resolve_batch(self.dist.world_size)
        self.out = cfg.out_dir
        self.lock = None
        made_out = not self.out.exists()
        try:
            # one writer per --out: rank 0 writes for the job (if it cannot take the lock, every rank stops)
            self.lock = self.dist.main_does(lambda: lock_out(self.out, self.print))
            self._build()
        except BaseException:  # a failed start leaves no --out behind that it made (its lock file alone)
            self.close()
            # never another run's --out: one that made it at the same moment and won its lock
            if made_out and self.dist.is_main and (self.lock is not None or not (self.out / RunLock.NAME).exists()):
                remove_if_only_lock(self.out)
            raise

    def _build(self) -> None:
        """The data, model, optimizer and run state, once --out is locked."""
        from .data import BatchLoader, PretrainingDataset, check_dataset, dataset_tokenizer, verify_checksums

        cfg = self.cfg
        # data: the dataset is checked against the model before any weight is made
        data_path = Path(cfg.data) if cfg.data else self._default_dataset()
        word_starts = cfg.masking != "token"
        self.train_data, self.valid_data = (
            PretrainingDataset(data_path, split, cfg.seq_len, cfg.mode, pack=cfg.pack, word_starts=word_starts)
            for split in ("train", "valid"))
        if cfg.data_checksums and self.dist.local_rank == 0:  # once per machine; sizes: checked on opening
            verify_checksums(data_path, log=self.print)
        manifest = self.manifest = self.train_data.manifest
        self.tokenizer = dataset_tokenizer(data_path, manifest)  # for the export: checked before training
        self.model_config = self._model_config(manifest)
        check_dataset(manifest, vocab_size=self.model_config.vocab_size)
        self.special_ids = sorted({manifest[k] for k in ("bos_id", "pad_id", "eos_id", "unk_id", "mask_id")})
        self.loader = BatchLoader(self.train_data, cfg.batch_size, seed=cfg.seed, rank=self.dist.rank,
                                  world_size=self.dist.world_size, accum_steps=self.grad_accum,
                                  prefetch=cfg.prefetch, pin_memory=self.device.type == "cuda")
        self.eval_batches = self._eval_batches()

        # model, optimizer and the state that checkpoints carry
        seed_everything(cfg.seed)
        self.with_sbo = cfg.objective == "mlm+sbo"  # SpanBERT: the span boundary head beside the MLM head
        model_class = RobertaForSpanBERT if self.with_sbo else RobertaForMaskedLM
        if cfg.init_from:
            self.model = self._init_model(model_class)
        else:
            self.model = model_class(self.model_config, backend=cfg.backend)
        self.model.to(self.device)
        self.model.check_inputs = False  # ids come from a dataset checked against the vocabulary
        if cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.ddp = None
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True)
        # dropout streams differ per rank; rank 0 keeps the single-process stream
        seed_everything(cfg.seed + 1_000_003 * self.dist.rank)
        self.optimizer = Optimizer(self.model, cfg)
        self.schedule = WarmupLinearDecay(cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.min_lr)
        self.scaler = DynamicLossScaler(cfg.init_loss_scale, cfg.loss_scale_window,
                                        enabled=self.precision == "fp16")
        self.step = 0
        self.tokens_seen = 0
        self.resumed_from = None  # (path, step) of the --resume PATH this run's line of checkpoints started from
        self.window = self._new_window()  # sums over the steps since the last log line
        self.checkpoints = CheckpointManager(self.out / "checkpoints", keep=cfg.keep_checkpoints, log=self.print)

    # ------------------------------------------------------------------ setup helpers
    def _default_dataset(self) -> Path:
        from .corpus import default_dataset

        if self.dist.is_main:
            path = default_dataset()
        self.dist.barrier()  # rank 0 builds it once; the others then find it cached
        if not self.dist.is_main:
            path = default_dataset()
        return path

    def _init_model(self, model_class):
        """The --init-from model's weights, or ValueError in one line naming the directory."""
        try:
            # model_config: the directory's config with --dropout applied
            return model_class.from_pretrained(self.init_dir, backend=self.cfg.backend, config=self.model_config)
        except Exception as err:
            raise ValueError(f"--init-from {self.cfg.init_from!r}: cannot load the model from {self.init_dir} "
                             f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}); "
                             "pass a directory save_pretrained wrote (config.json + weights) or a Hub name") from None

    def _model_config(self, manifest: dict) -> RobertaConfig:
        cfg = self.cfg
        if cfg.init_from:
            try:
                self.init_dir = model_dir(cfg.init_from)  # a Hub name is downloaded here
            except FileNotFoundError as err:
                raise ValueError(f"--init-from: {err}") from err
            if not (Path(self.init_dir) / "config.json").is_file():
                raise ValueError(f"--init-from {cfg.init_from!r} is not a Hugging Face model directory "
                                 "(no config.json); pass the directory save_pretrained wrote or a Hub name")
            try:
                mc = RobertaConfig.from_pretrained(self.init_dir)
            except (ValueError, TypeError, KeyError, OSError) as err:
                raise ValueError(f"--init-from {cfg.init_from!r}: cannot read {Path(self.init_dir) / 'config.json'} "
                                 f"({type(err).__name__}: {err})") from None
            if cfg.seq_len > mc.max_seq_len:
                raise ValueError(f"seq_len {cfg.seq_len} exceeds the {mc.max_seq_len} positions of "
                                 f"{cfg.init_from}; use --seq-len {mc.max_seq_len} or less")
            if mc.pad_token_id != manifest["pad_id"]:
                raise ValueError(f"{cfg.init_from} pads with id {mc.pad_token_id} but the dataset with "
                                 f"{manifest['pad_id']}; preprocess with the model's tokenizer")
            self._check_init_tokenizer(manifest)
            # the sizes are the model's: a size flag may only repeat them; the dropout flag applies
            other = [f"--{k.replace('_', '-')} {getattr(cfg, k)} (the model has {getattr(mc, k)})"
                     for k in SIZE_FIELDS if getattr(cfg, k) is not None and getattr(cfg, k) != getattr(mc, k)]
            if other:
                raise ValueError(f"sizes given contradict the --init-from model {cfg.init_from!r}: {', '.join(other)}; "
                                 "drop those flags (a model keeps its sizes), or train one of these sizes from "
                                 "scratch, without --init-from")
            if cfg.dropout is not None:
                mc = dataclasses.replace(mc, hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout)
            return mc
        overrides = {k: getattr(cfg, k) for k in SIZE_FIELDS if getattr(cfg, k) is not None}
        if cfg.dropout is not None:
            overrides.update(hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout)
        base = RobertaConfig.preset(cfg.model)
        pad = manifest["pad_id"]
        positions = max(base.max_position_embeddings, cfg.seq_len + pad + 1)
        return RobertaConfig.preset(cfg.model, vocab_size=manifest["vocab_size"], pad_token_id=pad,
                                    bos_token_id=manifest["bos_id"], eos_token_id=manifest["eos_id"],
                                    max_position_embeddings=positions, **overrides)

    def _check_init_tokenizer(self, manifest: dict) -> None:
        """Refuse an --init-from model whose tokenizer is not the one the dataset was made with: a
        same-sized vocabulary of other tokens would train the model on ids that mean other words to it.
        A model directory without tokenizer files is refused too, naming the files to add, since
        then nothing shows which ids its embeddings learned."""
        from .tokenizer import RobertaTokenizer

        name = self.cfg.init_from
        try:
            directory = Path(tokenizer_dir(name))  # a Hub name: its tokenizer files are fetched
        except FileNotFoundError as err:
            raise ValueError(f"--init-from: {err}") from None
        if not ((directory / "tokenizer.json").is_file()
                or ((directory / "vocab.json").is_file() and (directory / "merges.txt").is_file())):
            raise ValueError(f"--init-from {name!r} has no tokenizer (tokenizer.json, or vocab.json + merges.txt), "
                             "so the dataset cannot be checked against the ids the model learned; copy the files "
                             f"of the tokenizer the model was trained with into {str(directory)!r} and rerun")
        try:
            model_hash = RobertaTokenizer.from_pretrained(directory).tokenizer_hash
        except ValueError as err:
            raise ValueError(f"--init-from {name!r}: cannot load its tokenizer ({err})") from None
        if model_hash != manifest["tokenizer_hash"]:
            raise ValueError(f"the dataset was tokenized with tokenizer {manifest['tokenizer_hash'][:12]}, but "
                             f"--init-from {name!r} was trained with tokenizer {model_hash[:12]} (its ids mean other "
                             f"tokens); preprocess the text again with --tokenizer {name}")

    def _eval_batches(self) -> list[dict]:
        """The validation set's first samples (at most eval_batches x batch_size, split over ranks)."""
        n = min(len(self.valid_data), self.cfg.eval_batches * self.cfg.batch_size)
        if n == 0:
            raise ValueError(f"the dataset's valid split holds no sequence of {self.cfg.seq_len} tokens; "
                             "preprocess with a larger --valid-fraction")
        r, w = self.dist.rank, self.dist.world_size
        lo, hi = r * n // w, (r + 1) * n // w  # contiguous, so masks do not depend on world size
        batches = []
        for start in range(lo, hi, self.cfg.batch_size):
            batch = self.valid_data.batch(range(start, min(hi, start + self.cfg.batch_size)))
            batch["sample_offset"] = start
            batches.append(batch)
        return batches

    # ------------------------------------------------------------------ the step
    def mask(self, batch: dict, step: int, sample_offset: int, seed: int):
        """(inputs, labels, the model's other inputs) on the device for one micro-batch.

        The other inputs: attention_mask where there is padding, or, for packed rows,
        position_ids, cu_seqlens and max_seqlen (attention kept inside each document);
        with the SBO, the masked spans' boundaries (`spans`).
        """
        from .masking import mask_tokens

        ids = batch["input_ids"].to(self.device, non_blocking=True)
        if "cu_seqlens" in batch:
            extra = {"position_ids": batch["position_ids"].to(self.device, non_blocking=True),
                     "cu_seqlens": batch["cu_seqlens"].to(self.device, non_blocking=True),
                     "max_seqlen": batch["max_seqlen"]}
        elif bool(batch["attention_mask"].all()):
            extra = {}
        else:
            extra = {"attention_mask": batch["attention_mask"].to(self.device, non_blocking=True)}
        word_starts = batch.get("word_starts")
        if word_starts is not None:
            word_starts = word_starts.to(self.device, non_blocking=True)
        m, c = self.manifest, self.cfg
        inputs, labels, *spans = mask_tokens(
            ids, seed=seed, step=step, vocab_size=m["vocab_size"], mask_token_id=m["mask_id"],
            pad_token_id=m["pad_id"], special_token_ids=self.special_ids, mlm_probability=c.mlm_probability,
            mask_replace_prob=c.mask_replace_prob, random_replace_prob=c.random_replace_prob,
            strategy=c.masking, word_starts=word_starts, sample_offset=sample_offset, return_spans=self.with_sbo)
        if spans:
            extra["spans"] = spans[0]
        return inputs, labels, extra

    def predicted_counts(self, labels, extra) -> torch.Tensor:
        """(tokens the MLM predicts, tokens the SBO predicts) of one micro-batch, on the device."""
        mlm = labels.ne(IGNORE_INDEX).sum()
        sbo = self.model.sbo.target_mask(labels, extra["spans"]).sum() if self.with_sbo else torch.zeros_like(mlm)
        return torch.stack([mlm, sbo]).float()

    @staticmethod
    def loss_sums(out) -> torch.Tensor:
        """(MLM loss sum, SBO loss sum) of a forward with loss_reduction="sum"."""
        if hasattr(out, "sbo_loss"):
            return torch.stack([out.mlm_loss.float(), out.sbo_loss.float()])
        return torch.stack([out.loss.float(), torch.zeros_like(out.loss, dtype=torch.float32)])

    def next_micro_batches(self) -> list[dict]:
        """This rank's `grad_accum` micro-batches of the next step, from the prefetching loader."""
        if not hasattr(self, "_batches"):
            self._batches = self.loader.forever()
        return [next(self._batches) for _ in range(self.grad_accum)]

    def train_step(self, micro_batches: list[dict]) -> dict:
        """One optimizer step over this rank's micro-batches; returns its (global) statistics."""
        cfg, w = self.cfg, self.dist.world_size
        model = self.ddp or self.model
        model.train()
        per_micro = cfg.batch_size * w  # sequences of one micro-step over all ranks
        # counts: (MLM predicted, SBO predicted, non-pad tokens, attended pairs); each loss is a mean over its
        # own predicted tokens; the last two are for tokens/s and MFU
        masked, counts = [], torch.zeros(4, dtype=torch.float32, device=self.device)
        tokens = pairs = 0
        for m, batch in enumerate(micro_batches):
            offset = m * per_micro + self.dist.rank * cfg.batch_size  # the row's position in the step (BatchLoader)
            inputs, labels, extra = self.mask(batch, self.step, offset, cfg.seed)
            counts[:2] += self.predicted_counts(labels, extra)
            tokens += int(batch["attention_mask"].sum())
            pairs += attended_pairs(batch)
            masked.append((inputs, labels, extra))
        counts[2:] = torch.tensor([tokens, pairs])  # this rank's; ranks' rows differ in padding (tokens: exact
        # below 2^24 a step)
        self.dist.all_reduce(counts)  # the whole step's counts, all ranks
        factors = (w * self.scaler.scale) / counts[:2].clamp_min(1.0)  # DDP averages: x world_size
        loss_sums = torch.zeros(2, dtype=torch.float32, device=self.device)
        for m, (inputs, labels, extra) in enumerate(masked):
            last = m == len(masked) - 1
            sync = contextlib.nullcontext() if (self.ddp is None or last) else self.ddp.no_sync()
            with sync:
                with autocast(self.precision, self.device):
                    out = model(inputs, labels=labels, masked_only=True, loss_reduction="sum", **extra)
                sums = self.loss_sums(out)
                (sums * factors).sum().backward()
            loss_sums += sums.detach()
        lr = self.schedule.lr()
        grad_norm, found_inf = self.optimizer.step(lr, self.scaler.scale)
        self.optimizer.zero_grad()
        self.scaler.update(found_inf)
        if not found_inf:
            self.schedule.step()
        self.step += 1
        tokens = int(counts[2])  # all ranks' non-pad tokens (read after the optimizer's sync: no extra wait)
        self.tokens_seen += tokens
        return {"loss_sum": loss_sums[0], "count": counts[0], "sbo_loss_sum": loss_sums[1], "sbo_count": counts[1],
                "lr": lr, "grad_norm": grad_norm, "skipped": found_inf, "tokens": tokens, "pairs": float(counts[3])}

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation MLM loss, perplexity and masked-token accuracy over the fixed eval set
        (and the SBO loss, with the SBO)."""
        self.model.eval()
        # MLM loss sum, SBO loss sum, MLM predicted, SBO predicted, MLM correct
        totals = torch.zeros(5, dtype=torch.float64, device=self.device)
        for batch in self.eval_batches:
            inputs, labels, extra = self.mask(batch, 0, batch["sample_offset"], EVAL_MASK_SEED)
            with autocast(self.precision, self.device):
                out = self.model(inputs, labels=labels, masked_only=True, loss_reduction="sum", **extra)
            predicted = labels.ne(IGNORE_INDEX)
            correct = out.logits.argmax(-1).eq(labels[predicted])  # logits: (num_predicted, vocab)
            totals += torch.cat([self.loss_sums(out), self.predicted_counts(labels, extra),
                                 correct.sum().float()[None]]).double()
        self.dist.all_reduce(totals)
        self.model.train()
        loss_sum, sbo_loss_sum, count, sbo_count, correct = totals.tolist()
        loss = loss_sum / max(count, 1.0)
        perplexity = math.exp(loss) if not loss >= 709.0 else math.inf  # (exp overflows past 709; NaN stays NaN)
        result = {"loss": loss, "perplexity": perplexity, "accuracy": correct / max(count, 1.0),
                  "predicted_tokens": int(count)}
        if self.with_sbo:
            result.update(sbo_loss=sbo_loss_sum / max(sbo_count, 1.0), sbo_predicted_tokens=int(sbo_count))
        return result

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The whole training state; collective (every rank contributes its RNG state)."""
        rngs = self.dist.gather_objects(rng_state(self.device))
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict(),
            "loader": self.loader.state_dict(),
            # the log interval in progress, so the first line after a resume averages the same steps
            "window": self._window_state(),
            "rng": rngs,
            "world_size": self.dist.world_size,
            "config": {**self.cfg.to_dict(), "data": absolute_if_local(self.cfg.data)},  # export reads it anywhere
            "model_config": self.model_config.to_dict(),
            "tokenizer_hash": self.manifest["tokenizer_hash"],  # the ids' tokenizer: export and resume check it
            "resumed_from": self.resumed_from,  # tells a rerun of --resume PATH from a rollback to PATH
        }

    def load_state_dict(self, state: dict) -> None:
        saved = state["model_config"]
        mine = self.model_config.to_dict()
        diff = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size", "max_position_embeddings") if saved.get(k) != mine.get(k)]
        if diff:
            raise ValueError("the checkpoint's model differs from this config in "
                             + ", ".join(f"{k} ({saved.get(k)} vs {mine.get(k)})" for k in diff)
                             + "; resume with the same model settings or a new --out")
        saved_objective = "mlm+sbo" if any(k.startswith("sbo.") for k in state["model"]) else "mlm"
        if saved_objective != self.cfg.objective:
            raise ValueError(f"the checkpoint was trained with --objective {saved_objective}, this run asks for "
                             f"--objective {self.cfg.objective}; resume with --objective {saved_objective}, or use a "
                             "new --out (with --init-from the run's export to go on under another objective)")
        saved_tokenizer, tokenizer = state.get("tokenizer_hash"), self.manifest["tokenizer_hash"]
        if saved_tokenizer is not None and saved_tokenizer != tokenizer:
            raise ValueError(f"the checkpoint was trained on ids of tokenizer {saved_tokenizer[:12]}, but the dataset "
                             f"{self.train_data.path} holds ids of tokenizer {tokenizer[:12]}; resume with the run's "
                             "dataset, or use a new --out")
        if int(state["step"]) > self.cfg.max_steps:
            raise ValueError(f"the checkpoint is at step {state['step']}, past --max-steps {self.cfg.max_steps}; "
                             "resume with a larger --max-steps or use a new --out")
        saved_warmup = state["schedule"].get("warmup_steps")
        if getattr(self.cfg, "warmup_from_preset", False) and saved_warmup not in (None, self.schedule.warmup_steps) \
                and saved_warmup <= self.schedule.total_steps:  # the command left the warmup to the preset
            self.print(f"note: resuming on the checkpoint's {saved_warmup} warmup steps (--warmup-steps not given; "
                       f"a new run of this command warms up for {self.schedule.warmup_steps})")
            self.schedule.warmup_steps = self.cfg.warmup_steps = saved_warmup
        check_schedule(state["schedule"], self.schedule, SCHEDULE_SETTINGS, self.cfg.allow_schedule_change,
                       self.print)
        self.model.load_state_dict(state["model"])
        changed = self.optimizer.load_state_dict(state["optimizer"])
        if changed:
            self.print(f"note: the optimizer goes on with this run's settings, not the checkpoint's: "
                       f"{', '.join(changed)}")
        self.schedule.load_state_dict(state["schedule"])
        self.scaler.load_state_dict(state["scaler"])
        self.loader.load_state_dict(state["loader"])
        batches = self.__dict__.pop("_batches", None)
        if batches is not None:  # batches prefetched from the old position
            batches.close()
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.resumed_from = state.get("resumed_from")
        self.window = self._new_window()
        saved = {k: v.to(self.device) for k, v in state["window"].items()}  # tokens/s: new clock
        if not self.dist.is_main:  # the loss sums are every rank's: rank 0 carries them, the others restart at 0
            saved.update(loss=torch.zeros_like(saved["loss"]), sbo_loss=torch.zeros_like(saved["sbo_loss"]))
        self.window.update(saved)
        rngs = state["rng"]
        if len(rngs) == self.dist.world_size:
            set_rng_state(rngs[self.dist.rank], self.device)
        else:  # another world size: the dropout streams cannot continue; start fresh ones
            self.print(f"note: the checkpoint was written by {len(rngs)} processes, this run has "
                       f"{self.dist.world_size}: dropout RNG streams are reseeded")
            seed_everything(self.cfg.seed + 1_000_003 * self.dist.rank + self.step)

    def save_checkpoint(self) -> Path | None:
        state = self.state_dict()  # collective
        return self.dist.main_does(lambda: self.checkpoints.save(self.step, state))  # a full disk stops every rank

    def maybe_resume(self) -> bool:
        """Load the checkpoint that `cfg.resume` names; True if one was loaded."""
        resume = self.cfg.resume
        if resume == "never":
            if self.checkpoints.latest() is not None:
                raise ValueError(f"{self.out} already holds checkpoints and --resume never was given; "
                                 "resume (--resume auto), or pick a new --out")
            return False
        skipped = []
        if resume == "auto":  # the newest checkpoint that verifies; damaged and unverifiable ones are skipped
            found = self.checkpoints.load_latest(trust=self.cfg.trust_checkpoint)
            if found is None:
                return False
            path, state, skipped = found
        else:  # the one named: damaged is an error
            path, state, skipped = self._resume_path(resume)
        with restoring(path):
            self.load_state_dict(state)
        self.print(f"resumed from {path} at step {self.step}")
        if skipped:
            self.dist.barrier()  # every rank has read its checkpoint before rank 0 moves files
            if self.dist.is_main:
                for bad, kind in skipped:
                    self.print(f"set the {kind} checkpoint aside as {self.checkpoints.set_aside(bad, kind).name}")
        return True

    def _resume_path(self, resume: str) -> tuple[Path, dict, list]:
        """--resume PATH's (path, state, checkpoints to set aside). A rerun of the same command goes on
        from the newest checkpoint that a run resumed from PATH wrote (PATH may be pruned by then), not
        back to PATH; a PATH behind --out's newest checkpoints of another line is a rollback (after a
        loss spike): that line's later checkpoints are set aside (kept), so that neither pruning nor a
        later --resume auto takes them for this run's."""
        path = Path(resume)
        if not path.exists():
            pruned = self._newer_in_out(str(path.resolve()))
            if pruned is not None:
                self.print(f"note: --resume {resume} is gone (pruned by --keep-checkpoints), but {pruned[0]} was "
                           "written by a run resumed from it: resuming from there")
                return pruned
        state = load_checkpoint(path, trust=self.cfg.trust_checkpoint, log=self.print)
        origin = [str(path.resolve()), int(state["step"])]
        newer = self._newer_in_out(*origin)
        if newer is not None:
            self.print(f"note: {self.out} holds a newer checkpoint than --resume {resume} (step {state['step']}) "
                       f"that a run resumed from it wrote: resuming from {newer[0]} instead (to go back to "
                       f"{resume}, use a new --out or move the newer checkpoints away)")
            return newer
        state["resumed_from"] = origin
        return path, state, [(later, "abandoned") for step, later in self.checkpoints.checkpoints() if step > origin[1]]

    def _newer_in_out(self, origin: str, step: int = -1) -> tuple[Path, dict, list] | None:
        """load_latest()'s (path, state, skipped) if --out's newest good checkpoint is past `step` and
        was written by a run resumed from the checkpoint at `origin` (its resolved path), else None."""
        steps = [s for s, _ in self.checkpoints.checkpoints()]
        if not steps or steps[-1] <= step:
            return None
        try:
            found = self.checkpoints.load_latest(trust=self.cfg.trust_checkpoint)
        except DamagedCheckpoint:  # none of them is usable
            return None
        if found is None or int(found[1]["step"]) <= step or (found[1].get("resumed_from") or [None])[0] != origin:
            return None
        return found

    # ------------------------------------------------------------------ the run
    def _eval_line(self, step: int, result: dict) -> str:
        """The validation line of `step`, the same at step 0 as later (the SBO loss with the SBO)."""
        ppl = result["perplexity"]
        ppl = f"{ppl:.1f}" if ppl < 1e6 else f"{ppl:.4g}"  # (not 300 digits for a diverged run)
        return (f"step {step}: validation loss {result['loss']:.4f}, perplexity {ppl}, "
                f"accuracy {result['accuracy']:.3f}" + (f", SBO loss {result['sbo_loss']:.4f}" if self.with_sbo else ""))

    def run(self, on_step=None) -> dict:
        """Train to max_steps (or stop_at / a stop signal); returns a summary dict."""
        cfg = self.cfg
        resumed = self.maybe_resume()
        if self.dist.is_main:  # resume "auto": a rerun from the file goes on from the latest checkpoint
            try:
                dataclasses.replace(cfg, resume="auto").save(self.out / "train_config.json")
            except OSError as err:
                if not is_no_space(err):
                    raise
                raise DiskSpaceError(f"no space left on the disk of {str(self.out)!r} (writing train_config.json): "
                                     "free some space, then rerun the same command") from None
        self.print(self.describe())
        log = MetricsLogger(self.out, cfg.max_steps, self.step, enabled=self.dist.is_main,
                            progress=cfg.progress, tensorboard=cfg.tensorboard, from_scratch=not resumed,
                            wandb_project=cfg.wandb_project, run_config=dataclasses.asdict(cfg))
        first_eval = last_eval = None
        status, stopped_by = "finished", None
        try:
            if not resumed and self.step == 0:
                first_eval = self.evaluate()
                log.log({"kind": "eval", "step": 0, **first_eval})
                log.write(self._eval_line(0, first_eval))
            end = min(cfg.max_steps, cfg.stop_at or cfg.max_steps)
            self.window["t0"] = time.perf_counter()
            with StopSignal() as stop:
                while self.step < end:
                    stats = self.train_step(self.next_micro_batches())
                    self._accumulate(stats)
                    if self.scaler.bad_in_a_row >= cfg.max_bad_steps:
                        self.save_checkpoint()
                        raise RuntimeError(self._nonfinite_message())
                    # not at --stop-at: the log interval goes on in the checkpoint, as in a straight run
                    if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                        log.log(self._train_record(stats))
                    log.advance(self.step)
                    if on_step is not None:
                        on_step(self)
                    paused = time.perf_counter()  # evaluation and saving do not count in tokens/s
                    if self.step % cfg.eval_every == 0 or self.step == cfg.max_steps:
                        last_eval = self.evaluate()
                        log.log({"kind": "eval", "step": self.step, **last_eval})
                        log.write(self._eval_line(self.step, last_eval))
                    stopped_by = self.dist.agreed_signal(stop)
                    if self.step % cfg.save_every == 0 or self.step == end or stopped_by:
                        path = self.save_checkpoint()
                        if stopped_by:
                            status = f"stopped by {stopped_by.name}"
                            log.write(f"{status} at step {self.step}; checkpoint {path}; "
                                      "rerun the same command to resume")
                            break
                    self.window["t0"] += time.perf_counter() - paused
            if self.step == cfg.max_steps and status == "finished":
                if cfg.export:
                    with ExportSignal():  # on every rank: the others wait for rank 0's export
                        self.dist.main_does(lambda: self.export(self.out / "final"))
            elif status == "finished":
                status = f"stopped at step {self.step} (stop_at)"
                checkpoint = self.checkpoints.latest() if self.dist.is_main else None  # saved at this step
                log.write(f"stopped at step {self.step} (--stop-at {cfg.stop_at})"
                          + (f"; checkpoint {checkpoint}" if checkpoint else "")
                          + "; rerun with a later --stop-at, or without it, to go on")
        except BaseException:
            log.close(failed=True)
            raise
        finally:
            log.close()
        if self.dist.is_main and cfg.plot and status == "finished":
            try:
                png = plot_losses(self.out / "metrics.jsonl", self.out / "loss.png")
                self.print(f"loss plot: {png}" if png else "loss plot skipped: install matplotlib for it")
            except OSError as err:  # the run is done and exported: a plot is not worth failing it
                if not is_no_space(err):
                    raise
                self.print(f"loss plot skipped: no space left on the disk of {str(self.out)!r}")
        if self.dist.is_main:  # from the log, so a resumed run reports the whole run
            evals = [r for r in read_metrics(self.out / "metrics.jsonl") if r["kind"] == "eval"]
            loss = [("not finite" if r["loss"] is None else f"{r['loss']:.4f}") for r in evals]  # None: NaN / inf
            if len(evals) >= 2:
                self.print(f"validation MLM loss: first {loss[0]} (step {evals[0]['step']}) -> "
                           f"last {loss[-1]} (step {evals[-1]['step']})")
            if evals and evals[-1]["loss"] is None:
                self.print("warning: the last validation loss is not finite: the weights saved and exported at the "
                           "end do not work; lower --lr, check --weight-decay and --precision, and start again")
        # Every rank waits for rank 0's export: under gloo a rank that leaves the process group
        # while another still works can die of SIGABRT, and torchrun then fails the whole job.
        self.dist.barrier()
        # signal: the SIGTERM/SIGINT that stopped the run (python -m roberta_fast.train exits 128 + it)
        return {"status": status, "step": self.step, "first_eval": first_eval, "last_eval": last_eval,
                "signal": stopped_by}

    def _window_state(self) -> dict:
        """The log interval in progress, for a checkpoint: the loss sums over every rank (each rank adds
        only its own until a line is logged; counts are already global); collective."""
        sums = self.dist.all_reduce(torch.stack([self.window["loss"], self.window["sbo_loss"]]).clone())
        return {"loss": sums[0], "count": self.window["count"], "sbo_loss": sums[1],
                "sbo_count": self.window["sbo_count"]}

    def _new_window(self) -> dict:
        """The log interval's sums. loss / count (and sbo_*) average the loss over the steps that updated
        the weights, and go on across a resume (the checkpoint keeps them); tokens / predicted count
        the work done since t0, for tokens/s and MFU, and restart with the clock."""
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        return {"tokens": 0, "pairs": 0.0, "predicted": zero.clone(), "sbo_predicted": zero.clone(), "loss": zero,
                "count": zero.clone(), "sbo_loss": zero.clone(), "sbo_count": zero.clone(), "t0": time.perf_counter()}

    def _accumulate(self, stats: dict) -> None:
        window = self.window
        window["tokens"] += stats["tokens"]
        window["pairs"] += stats["pairs"]
        window["predicted"] += stats["count"]
        window["sbo_predicted"] += stats["sbo_count"]
        if stats["skipped"]:  # a non-finite loss or gradients (found on every rank alike): no update, no loss
            return
        window["loss"] += stats["loss_sum"]
        window["count"] += stats["count"]
        window["sbo_loss"] += stats["sbo_loss_sum"]
        window["sbo_count"] += stats["sbo_count"]

    def _train_record(self, stats: dict) -> dict:
        window = self.window
        # counts were summed over ranks at each step; the loss sums are summed here
        loss_sum, sbo_loss_sum = self.dist.all_reduce(torch.stack([window["loss"], window["sbo_loss"]])).tolist()
        count, sbo_count = float(window["count"]), float(window["sbo_count"])
        elapsed = time.perf_counter() - window["t0"]
        tokens_per_s = window["tokens"] / max(elapsed, 1e-9)
        predicted_per_s, sbo_predicted_per_s = (float(window[k]) / max(elapsed, 1e-9)
                                                for k in ("predicted", "sbo_predicted"))
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        w = self.dist.world_size
        record = {
            "kind": "train", "step": self.step, "loss": loss_sum / count if count else None,  # None: all skipped
            "lr": stats["lr"], "loss_scale": self.scaler.scale, "skipped_steps": self.scaler.skipped,
            "grad_norm": stats["grad_norm"], "tokens_per_s": tokens_per_s,
            "mfu": estimate_mfu(self.model_config, tokens_per_s / w, predicted_per_s / w, self.cfg.seq_len,
                                device_name, sbo_predicted_per_s / w, window["pairs"] / max(elapsed, 1e-9) / w),
            "memory_gb": memory_gb(self.device), "tokens_seen": self.tokens_seen,
        }
        if self.with_sbo:
            record["sbo_loss"] = sbo_loss_sum / sbo_count if sbo_count else None
        self.window = self._new_window()
        return record

    def _nonfinite_message(self) -> str:
        cause = ("fp16 overflow that loss scaling cannot absorb: try --precision bf16 (sm_80+ GPUs), or "
                 "--precision fp32 on older GPUs"
                 if self.precision == "fp16" else
                 f"a diverging run: lower --lr (now {self.cfg.lr}), lengthen --warmup-steps or set "
                 "--clip-grad-norm 1.0")
        return (f"the loss/gradients were not finite for {self.scaler.bad_in_a_row} consecutive steps, "
                f"up to step {self.step}; likely cause: {cause}. A checkpoint of the last good weights was "
                f"saved in {self.checkpoints.directory}")

    def _attention(self) -> str:
        return ops.describe_attention(ops.resolve_backend(self.model.backend, self.device), self.device)

    def describe(self) -> str:
        c, mc = self.cfg, self.model_config
        n = sum(p.numel() for p in self.model.parameters())
        return (
            "effective config:\n" + json.dumps(c.to_dict(), indent=1) + "\n"
            f"model: {f'--init-from {c.init_from}' if c.init_from else c.model} (L={mc.num_hidden_layers} "
            f"H={mc.hidden_size} A={mc.num_attention_heads} FFN={mc.intermediate_size} vocab={mc.vocab_size} "
            f"dropout {mc.hidden_dropout_prob}/{mc.attention_probs_dropout_prob}), {n / 1e6:.2f}M parameters, backend "
            f"{self.model.backend} (attention: {self._attention()}), objective "
            + ("MLM + span boundary (SpanBERT)" if self.with_sbo else "MLM") + "\n"
            f"device {self.device} x {self.dist.world_size} process(es), precision {self.precision} "
            f"({explain(c.precision, self.device)}); "
            f"batch {c.batch_size} x accum {self.grad_accum} x world {self.dist.world_size} = "
            f"{self.global_batch} sequences of {c.seq_len} tokens per step\n"
            f"data: {self.train_data.path} ({len(self.train_data)} train / {len(self.valid_data)} valid sequences)\n"
            f"output: {self.out}"
        )

    # ------------------------------------------------------------------ export
    def export(self, directory: Path) -> Path:
        """Save the model and tokenizer in Hugging Face format (atomically replacing `directory`)."""
        try:
            export_pretrained(self.model, self.tokenizer, directory)
        except DiskSpaceError as err:  # the checkpoint of this step was saved just before
            raise DiskSpaceError(f"{err}. The checkpoint of step {self.step} is kept: the rerun exports it "
                                 "without training again") from None
        self.print(f"exported the model and tokenizer (Hugging Face format) to {directory}")
        return directory

    def close(self) -> None:
        """Stop the loader's prefetch thread, leave the process group and release --out."""
        batches = self.__dict__.pop("_batches", None)
        if batches is not None:
            batches.close()
        self.dist.close()
        if getattr(self, "lock", None) is not None:
            self.lock.release()


# what an export writes (hf.save_pretrained, the SBO head, RobertaTokenizer.save): the files a directory
# may hold for an export to replace it
EXPORT_FILES = {"config.json", "model.safetensors", "model.safetensors.index.json", "sbo.safetensors",
                "tokenizer.json", "vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json"}


class ExportSignal(StopSignal):
    """While installed, SIGTERM and the first SIGINT let the final export finish (killed, it would be
    redone by the rerun); the run then ends as finished. A second Ctrl-C aborts it."""

    WHAT_NEXT = "finishing the export of the final model first (Ctrl-C again to abort it)"


def check_export_target(directory) -> Path:
    """`directory` resolved, or ValueError if an export there would delete something not an export's:
    it must be missing, empty, or an earlier export (the export replaces it whole)."""
    directory = Path(directory).resolve()
    if Path.cwd().resolve().is_relative_to(directory):
        raise ValueError(f"the export directory {str(directory)!r} is the current directory or holds it; "
                         "pass a new directory for the model")
    if not directory.exists():
        return directory
    if not directory.is_dir():
        raise ValueError(f"the export directory {str(directory)!r} is a file; pass a new directory for the model")
    other = sorted(p.name for p in directory.iterdir() if not (p.is_file() and (
        p.name in EXPORT_FILES or WEIGHT_SHARD.fullmatch(p.name))))
    if other:
        raise ValueError(f"the export directory {str(directory)!r} holds {', '.join(other[:4])}"
                         f"{', ...' if len(other) > 4 else ''}, which an export does not write: the export replaces "
                         "the directory whole and would delete them. Pass a new or empty directory (or an earlier "
                         "export's)")
    return directory


def export_pretrained(model, tokenizer, directory) -> Path:
    """Write `model` and `tokenizer` (a RobertaTokenizer, or a directory or Hub name to load one
    from) as one Hugging Face directory, atomically replacing `directory`: the exports of
    train and finetune, and any checkpoint's through `python -m roberta_fast.export`.

    ValueError if `directory` holds anything an export does not write (check_export_target).
    DiskSpaceError, in one line naming the directory and the room needed, if the disk has no
    room for it (checked first) or fills while writing; nothing half-written is left."""
    from .checkpoint import estimate_size
    from .files import temp_dir_for, temp_dirs_guarded
    from .integrity import human_bytes, is_no_space
    from .tokenizer import RobertaTokenizer

    directory = check_export_target(directory)
    if not isinstance(tokenizer, RobertaTokenizer):
        tokenizer = RobertaTokenizer.from_pretrained(tokenizer)
    directory.parent.mkdir(parents=True, exist_ok=True)
    # the weights (safetensors: their bytes and a header) and the tokenizer's files (about twice its JSON)
    need = estimate_size(model.state_dict()) + 2 * len(tokenizer.backend.to_str())

    def no_room(free: int) -> DiskSpaceError:
        return DiskSpaceError(
            f"not enough disk space to export the model to {str(directory)!r}: it needs about {human_bytes(need)} "
            f"and that disk has {human_bytes(free)} free; nothing was written there. Free some space (or "
            "choose another directory), then rerun the same command")

    with temp_dirs_guarded(directory):  # first removes the temporary directories of killed exports
        free = shutil.disk_usage(directory.parent).free
        if free < need:
            raise no_room(free)
        tmp = temp_dir_for(directory)  # a plain mkdir's permissions: the export can be shared
        try:
            model.save_pretrained(tmp)
            tokenizer.save(tmp, model_max_length=model.config.max_seq_len)  # transformers truncates to it
            old = directory.with_name(f".{directory.name}.old")
            if directory.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_no_space(err):
                raise no_room(shutil.disk_usage(directory.parent).free) from None
            raise
    return directory


def lock_out(out: Path, log=print) -> RunLock:
    """Create the output directory, prove it writable and take its one-writer lock (RunLock):
    train and finetune both, so two runs never write into one --out."""
    check_writable(out)
    return RunLock(out).acquire(log)


def remove_if_only_lock(out: Path) -> None:
    """Remove `out` if all it holds is its run.lock, or nothing (a start that failed in the directory it made)."""
    try:
        names = [p.name for p in out.iterdir()]
        if names in ([RunLock.NAME], []):
            (out / RunLock.NAME).unlink(missing_ok=True)
            out.rmdir()
    except OSError:
        pass


def check_writable(out: Path) -> None:
    """Create `out` and prove it writable, or raise ValueError naming it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as err:
        raise ValueError(f"output directory {str(out)!r} is not writable ({err.strerror}); "
                         "pass another --out") from None
