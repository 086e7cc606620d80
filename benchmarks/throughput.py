"""End-to-end RoBERTa pretraining throughput: roberta_fast against Hugging Face, in one run.

    python benchmarks/throughput.py                    # GPU: base/large x seq 128/512 x fp16/bf16
    python benchmarks/throughput.py --quick            # any machine, about a minute: tiny model
    python benchmarks/throughput.py --models base --seq-lens 512 --dtypes bf16 --batch 32
    python benchmarks/throughput.py --compare benchmarks/results/OLD.json

What is timed: whole training steps (host batch -> device, masking, forward, backward,
optimizer update, gradients cleared), after warm-up, `--repeats` blocks of `--steps`
steps each, timed with CUDA events (a clock and a synchronisation on the CPU); the
figure is the median block. Every contender trains the identical model size (random
init, dropout 0.1), batch, sequence length, precision (fp32 master weights + autocast;
fp16 adds dynamic loss scaling) and masking rate (15%: 80/10/10) on the same
FULL-SENTENCES-like batches (no padding):

  rf-fused      roberta_fast's trainer step (below) with backend="fused" (Triton kernels)
  rf-reference  the same step with backend="reference" (the model in plain PyTorch)
  rf-fused+sbo  rf-fused with SpanBERT's objective (--masking span --objective mlm+sbo): span
                masking returning the span boundaries, and the span boundary head's loss beside
                the MLM's, each scaled by its own predicted count; its MFU credits the MLM
                model's FLOPs only, so its tokens/s against rf-fused is the objective's cost
  hf-eager      transformers RobertaForMaskedLM (SDPA attention), torch AdamW(fused=True on CUDA,
                foreach on CPU), torch.autocast (+ GradScaler for fp16), batches masked on the
                host by DataCollatorForLanguageModeling from tokenizer-style examples with
                `special_tokens_mask`, as transformers' run_mlm.py does -- what users run today
  hf-compile    the same under torch.compile(model)

roberta_fast's step is `roberta_fast.trainer.Trainer.train_step`'s for one micro-batch on
one process, rebuilt from the trainer's own parts (mask_tokens on the device with the
trainer's arguments; the MLM head only over predicted tokens with a summed loss scaled
by loss-scale / predicted count; the trainer's DynamicLossScaler and Optimizer, i.e.
FusedAdam reading the gradient norm once per step), because train_step is a method of
a Trainer that must own a preprocessed dataset. A contender that cannot run (no GPU, a
missing package, an unfinished part raising NotImplementedError) is reported as
skipped with the reason, never dropped.

Figures per configuration and contender: ms/step, tokens/s, sequences/s, MFU
(roberta_fast.model.estimate_mfu: DESIGN.md's PaLM convention, predicted tokens for the
head, over the device's datasheet peak), peak device memory, and the ratio of tokens/s
to hf-eager and hf-compile. Output: a terminal table, `--json PATH` (schema in
benchmarks/results/README.md), a bar chart (`--chart PATH`, PNG with matplotlib, else
SVG), `--compare OLD.json`. A full run on a GPU is also recorded in benchmarks/results/
(one JSON per run, and the README table of the latest run per device) unless --no-record.
`--gate GATE.json` (benchmarks/gpu_gate.py's verdict, from the same gpu_session.sh call) marks
the figures verified or, kept all the same, unverified with the reason. `--refresh-record
STAGE.tgz ...` records the reports of the archives a GPU session hands back.

Measured on: nothing yet (no GPU run recorded; see benchmarks/results/README.md).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import re
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS_DIR = HERE / "results"
if str(HERE) not in sys.path:  # _common.py and plot.py sit beside this file
    sys.path.insert(0, str(HERE))
import _common as bc  # noqa: E402
from gpu_gate import SCHEMA as GATE_SCHEMA  # noqa: E402
from plot import atomic_write, throughput_chart  # noqa: E402

bc.use_interpreter_without_gpu()  # before triton is imported (only --interpret uses it)

SCHEMA = "roberta_fast.throughput/1"
CONTENDERS = ("rf-fused", "rf-reference", "rf-fused+sbo", "hf-eager", "hf-compile")
PEERS = {"hf-eager": "vs_hf_eager", "hf-compile": "vs_hf_compile"}  # ratio key per peer
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MLM_PROBABILITY = 0.15
# The issue's targets (H100, roberta-base, seq 512; the ratios also for large and seq 128).
TARGETS = {"vs_hf_eager": 2.0, "vs_hf_compile": 1.3, "mfu": 0.45}
TARGET_MODELS, TARGET_DTYPES = ("base", "large"), ("bf16", "fp16")
MFU_TARGET_SETTINGS = {("base", 512)}
BOS, PAD, EOS, UNK = 0, 1, 2, 3  # RoBERTa's special ids; <mask> is the last id


# ------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Setting:
    """One configuration: every contender runs exactly this."""

    model: str  # RobertaConfig preset: tiny | base | large
    seq_len: int
    dtype: str  # fp32 | fp16 | bf16
    batch: int

    @property
    def key(self) -> str:
        return f"{self.model}/seq{self.seq_len}/{self.dtype}"


def model_config(name: str):
    """The RobertaConfig preset `name` (tiny | base | large)."""
    from roberta_fast.config import RobertaConfig

    return RobertaConfig.preset(name)


# ---------------------------------------------------------------------- data
class HostBatches:
    """A few fixed batches of packed sequences on the host, cycled: the data loader's output.

    Each sequence is `<s> tokens </s> tokens ... </s>` with a document boundary in the middle
    (FULL-SENTENCES packing), ordinary ids drawn from [4, mask_id), no padding.
    """

    def __init__(self, vocab_size: int, batch: int, seq_len: int, count: int = 4, seed: int = 0,
                 pin: bool = False):
        g = torch.Generator().manual_seed(seed)
        mask_id = vocab_size - 1
        ids = torch.randint(UNK + 1, mask_id, (count, batch, seq_len), generator=g)  # (count, batch, seq)
        ids[:, :, 0] = BOS
        ids[:, :, seq_len // 2] = EOS
        ids[:, :, -1] = EOS
        self.ids = ids.pin_memory() if pin else ids
        self.i = 0

    def next(self) -> torch.Tensor:
        """The next (batch, seq_len) int64 batch on the host."""
        batch = self.ids[self.i % len(self.ids)]
        self.i += 1
        return batch

    def examples(self, batch: torch.Tensor) -> list[dict]:
        """The batch as run_mlm.py's tokenized examples: lists with a special-tokens mask."""
        special = (batch <= UNK).int()
        return [{"input_ids": row, "special_tokens_mask": s} for row, s in
                zip(batch.tolist(), special.tolist())]


def hf_tokenizer(vocab_size: int):
    """A RobertaTokenizerFast with RoBERTa's special ids and `vocab_size` ids, built offline.

    DataCollatorForLanguageModeling reads only the special ids and len(tokenizer) (for the
    random replacements), so the vocabulary is synthetic: no download, no training.
    """
    from tokenizers import Tokenizer, models
    from transformers import RobertaTokenizerFast

    vocab = {"<s>": BOS, "<pad>": PAD, "</s>": EOS, "<unk>": UNK}
    vocab.update({f"t{i}": i for i in range(UNK + 1, vocab_size - 1)})
    vocab["<mask>"] = vocab_size - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    hf = RobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                              cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")
    if len(hf) != vocab_size or hf.mask_token_id != vocab_size - 1:
        raise RuntimeError(f"synthetic tokenizer has {len(hf)} ids and <mask>={hf.mask_token_id}, "
                           f"expected {vocab_size} and {vocab_size - 1}")
    return hf


# ----------------------------------------------------------------- contenders
class Skip(Exception):
    """A contender that cannot run here; the message is the reason shown to the user."""


@dataclass
class Run:
    """A built contender: `step()` runs one training step and returns its predicted-token count
    (an int or a device tensor, so that counting never synchronises)."""

    step: Callable[[], object]
    notes: str = ""  # what exactly ran (optimizer, library version), kept in the report
    close: Callable[[], None] = lambda: None
    facts: dict = field(default_factory=dict)  # extra figures for the report row
    model: object = None  # the module it trains (roberta_fast's contenders), for tests


def _scaler(dtype: str, device):
    """torch's dynamic loss scaler, enabled for fp16 only (a pass-through otherwise)."""
    return torch.amp.GradScaler(device.type, enabled=dtype == "fp16")


def build_rf(setting: Setting, device, backend: str, interpret: bool, sbo: bool = False) -> Run:
    """roberta_fast's training step, as `roberta_fast.trainer.Trainer.train_step` runs it.

    Built from the trainer's parts (its Optimizer: FusedAdam with the gradient norm read
    once per step; its DynamicLossScaler, autocast, and mask_tokens called with its
    arguments) because train_step is a method of a Trainer that must own a preprocessed
    dataset; this is one micro-batch on one process. rf-fused and rf-reference differ only
    in the model's backend; sbo=True adds SpanBERT's objective as `--objective mlm+sbo` does
    (span masking over word starts at every ordinary token, as for a byte-level BPE of
    space-separated words, and the span boundary head).
    """
    if backend == "fused" and device.type != "cuda" and not interpret:
        raise Skip("the fused backend's Triton kernels need a CUDA GPU (on a CPU they run only in "
                   "Triton's interpreter, a correctness tool; pass --interpret to time it anyway)")
    import roberta_fast as rf
    from roberta_fast.model import IGNORE_INDEX
    from roberta_fast.precision import DynamicLossScaler, autocast
    from roberta_fast.train_config import TrainConfig
    from roberta_fast.trainer import Optimizer

    cfg = model_config(setting.model)
    train_cfg = TrainConfig.preset(setting.model, backend=backend, precision=setting.dtype,
                                   seq_len=setting.seq_len, batch_size=setting.batch,
                                   masking="span" if sbo else "token", objective="mlm+sbo" if sbo else "mlm",
                                   mlm_probability=MLM_PROBABILITY)
    model_class = rf.RobertaForSpanBERT if sbo else rf.RobertaForMaskedLM
    try:
        model = model_class(cfg, backend=backend).to(device).train()
    except NotImplementedError as err:
        raise Skip(f"backend={backend!r} is unfinished: {err}") from err
    model.check_inputs = False  # the batches are valid by construction, as the trainer's are
    try:
        from roberta_fast.masking import mask_tokens

        optimizer = Optimizer(model, train_cfg)
    except (ImportError, AttributeError, NotImplementedError) as err:
        raise Skip(f"a roberta_fast part is missing or unfinished: {type(err).__name__}: {err}") from err
    scaler = DynamicLossScaler(train_cfg.init_loss_scale, train_cfg.loss_scale_window,
                               enabled=setting.dtype == "fp16")
    batches = HostBatches(cfg.vocab_size, setting.batch, setting.seq_len, pin=device.type == "cuda")
    special = [BOS, PAD, EOS, UNK, cfg.vocab_size - 1]
    counter = iter(range(1 << 62))
    word_starts = (batches.next() > UNK).to(device) if sbo else None  # every ordinary token starts a word

    def step():
        ids = batches.next().to(device, non_blocking=True)
        inputs, labels, *spans = mask_tokens(
            ids, seed=train_cfg.seed, step=next(counter), vocab_size=cfg.vocab_size,
            mask_token_id=cfg.vocab_size - 1, pad_token_id=PAD, special_token_ids=special,
            mlm_probability=train_cfg.mlm_probability, mask_replace_prob=train_cfg.mask_replace_prob,
            random_replace_prob=train_cfg.random_replace_prob, strategy=train_cfg.masking,
            word_starts=word_starts, sample_offset=0, return_spans=sbo)
        count = labels.ne(IGNORE_INDEX).sum().float()
        with autocast(setting.dtype, device):
            out = model(inputs, attention_mask=None, labels=labels, masked_only=True, loss_reduction="sum",
                        **({"spans": spans[0]} if sbo else {}))
        if sbo:  # each loss a mean over its own predicted tokens, as Trainer.train_step
            sbo_count = model.sbo.target_mask(labels, spans[0]).sum().float()
            loss = out.mlm_loss / count.clamp_min(1.0) + out.sbo_loss / sbo_count.clamp_min(1.0)
        else:
            loss = out.loss / count.clamp_min(1.0)
        (loss * scaler.scale).backward()
        _, found_inf = optimizer.step(train_cfg.lr, scaler.scale)
        optimizer.zero_grad()
        scaler.update(found_inf)
        return count

    return Run(step, notes=f"backend={backend}, trainer Optimizer ({type(optimizer.opt).__name__})"
                           + (", span masking + span boundary objective" if sbo else ""), model=model)


def build_hf(setting: Setting, device, compile_model: bool) -> Run:
    """transformers' RobertaForMaskedLM step as users run it (see the module docstring)."""
    from roberta_fast.precision import autocast

    try:
        import transformers
    except ImportError as err:
        raise Skip(f"transformers is not installed ({err}); `pip install transformers`") from err
    if compile_model and not hasattr(torch, "compile"):
        raise Skip("this torch has no torch.compile")
    cfg = model_config(setting.model)
    hf_cfg = transformers.RobertaConfig(**cfg.to_dict())
    model = transformers.RobertaForMaskedLM._from_config(hf_cfg, attn_implementation="sdpa").to(device).train()
    collator = transformers.DataCollatorForLanguageModeling(hf_tokenizer(cfg.vocab_size),
                                                            mlm_probability=MLM_PROBABILITY)
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01, **kind)
    scaler = _scaler(setting.dtype, device)
    forward = torch.compile(model) if compile_model else model
    batches = HostBatches(cfg.vocab_size, setting.batch, setting.seq_len)

    def step():
        batch = collator(batches.examples(batches.next()))  # masks on the host (a fresh copy)
        predicted = int(batch["labels"].ne(-100).sum())
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with autocast(setting.dtype, device):
            loss = forward(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return predicted

    def close():
        if compile_model:
            torch._dynamo.reset()

    # The host's share, for the reader: collation alone (it overlaps the GPU unless a step syncs).
    collate_ms = []
    for _ in range(3):
        t0 = time.perf_counter()
        collator(batches.examples(batches.next()))
        collate_ms.append((time.perf_counter() - t0) * 1e3)
    return Run(step, notes=f"transformers {transformers.__version__}, sdpa, "
                           f"{'torch.compile' if compile_model else 'eager'}", close=close,
               facts={"host_collate_ms": statistics.median(collate_ms)})


def build(name: str, setting: Setting, device, args) -> Run:
    """Build contender `name` for `setting`; raises Skip with the reason when it cannot run."""
    if name == "rf-fused":
        return build_rf(setting, device, "fused", args.interpret)
    if name == "rf-reference":
        return build_rf(setting, device, "reference", args.interpret)
    if name == "rf-fused+sbo":
        return build_rf(setting, device, "fused", args.interpret, sbo=True)
    if name == "hf-eager":
        return build_hf(setting, device, compile_model=False)
    if name == "hf-compile":
        if args.skip_compile:
            raise Skip("--skip-compile was given")
        return build_hf(setting, device, compile_model=True)
    raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS}")


# --------------------------------------------------------------------- timing
def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(step, device, steps: int) -> None:
    """Run `steps` untimed steps (compilation, autotuning, allocator growth) and wait for them."""
    for _ in range(steps):
        step()
    synchronize(device)


def time_blocks(step, device, warmup: int, steps: int, repeats: int):
    """Seconds per step of each of `repeats` blocks of `steps` steps, after `warmup` steps.

    Also returns the mean predicted tokens per step. CUDA events bracket each block on a
    GPU (one synchronisation per block); perf_counter after a synchronisation elsewhere.
    """
    warm_up(step, device, warmup)
    per_step, predicted = [], 0
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                predicted = predicted + step()
            end.record()
            end.synchronize()
            per_step.append(start.elapsed_time(end) / 1e3 / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                predicted = predicted + step()
            per_step.append((time.perf_counter() - t0) / steps)
    return per_step, float(predicted) / (steps * repeats)


def is_oom(err: BaseException) -> bool:
    """Out of device memory, however it surfaced (torch, cuBLAS, a Triton launch)."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower() \
        or "CUBLAS_STATUS_ALLOC_FAILED" in str(err)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(name: str, setting: Setting, device, args) -> dict:
    """Build, warm up and time one contender; a result row (status ok | skipped | failed)."""
    from roberta_fast.model import estimate_mfu

    row = {"contender": name, "model": setting.model, "seq_len": setting.seq_len,
           "dtype": setting.dtype, "batch": setting.batch}
    run = None
    _free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        run = build(name, setting, device, args)
        row["notes"], facts = run.notes, run.facts
        per_step, predicted = time_blocks(run.step, device, args.warmup, args.steps, args.repeats)
    except Skip as why:
        return {**row, "status": "skipped", "reason": str(why)}
    except Exception as err:  # a broken contender is reported, and the others still run
        if is_oom(err):
            return {**row, "status": "failed", "reason": f"out of memory at batch {setting.batch}"}
        if args.verbose:
            traceback.print_exc()
        return {**row, "status": "failed", "reason": f"{type(err).__name__}: {err}".strip()[:500]}
    finally:
        if run is not None:
            run.close()
        del run
    seconds = statistics.median(per_step)
    tokens = setting.batch * setting.seq_len
    mfu = estimate_mfu(model_config(setting.model), tokens / seconds, predicted / seconds,
                       setting.seq_len, device_name(device))
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    _free(device)
    return {**row, **facts, "status": "ok", "ms_per_step": seconds * 1e3,
            "ms_per_step_blocks": [s * 1e3 for s in per_step],
            "tokens_per_s": tokens / seconds, "sequences_per_s": setting.batch / seconds,
            "predicted_per_step": predicted, "mfu": None if math.isnan(mfu) else mfu,
            "peak_memory_gib": peak}


def find_batch(model: str, seq_len: int, dtype: str, device, args, names) -> tuple[int, str]:
    """The largest power-of-two batch at which every (eager) contender runs two steps.

    torch.compile is not probed (it recompiles per shape, and its memory is at most eager's
    in practice); a contender that then runs out of memory is reported as failed.
    """
    top = max(1, args.max_tokens // seq_len)
    batch = 1 << (top.bit_length() - 1)
    eager = [n for n in names if n != "hf-compile"]
    while batch >= 1:
        if not any(probe_oom(n, Setting(model, seq_len, dtype, batch), device, args) for n in eager):
            return batch, "largest power of two that fits every eager contender"
        batch //= 2
    raise RuntimeError(f"not even batch 1 fits for {model} seq {seq_len} {dtype}")


def probe_oom(name, setting, device, args) -> bool:
    """Whether two steps of the contender run out of device memory (other errors show later)."""
    run = None
    _free(device)
    try:
        run = build(name, setting, device, args)
        warm_up(run.step, device, 2)
    except Exception as err:  # skipped or broken: measure() reports it; it does not limit the batch
        return is_oom(err)
    finally:
        if run is not None:
            run.close()
        del run
        _free(device)
    return False


# ------------------------------------------------------------------- results
def add_ratios(rows: list[dict]) -> None:
    """Each ok row gets tokens/s over each peer's in the same setting (None if the peer did not run)."""
    by = {(r["model"], r["seq_len"], r["dtype"], r["contender"]): r for r in rows}
    for r in rows:
        for peer, key in PEERS.items():
            p = by.get((r["model"], r["seq_len"], r["dtype"], peer))
            ok = r["status"] == "ok" and p is not None and p["status"] == "ok"
            r[key] = r["tokens_per_s"] / p["tokens_per_s"] if ok else None


def evaluate_targets(rows: list[dict], device) -> list[dict]:
    """The issue's targets for rf-fused, each with achieved, met and how far off.

    Targets are for a GPU run: on a CPU every target is reported as not evaluated.
    """
    out = []
    for r in rows:
        if r["contender"] != "rf-fused" or r["model"] not in TARGET_MODELS or r["dtype"] not in TARGET_DTYPES:
            continue
        names = ["vs_hf_eager", "vs_hf_compile"]
        if (r["model"], r["seq_len"]) in MFU_TARGET_SETTINGS:
            names.append("mfu")
        for metric in names:
            t = {"model": r["model"], "seq_len": r["seq_len"], "dtype": r["dtype"], "metric": metric,
                 "target": TARGETS[metric]}
            achieved = r.get(metric) if r["status"] == "ok" else None
            if device.type != "cuda":
                t.update(status="not evaluated", reason="the targets are for an H100 GPU run")
            elif achieved is None:
                t.update(status="not evaluated", reason="rf-fused or the peer did not run")
            else:
                met = achieved >= TARGETS[metric]
                t.update(status="met" if met else "missed", achieved=achieved,
                         shortfall=0.0 if met else TARGETS[metric] - achieved,
                         shortfall_fraction=0.0 if met else 1.0 - achieved / TARGETS[metric])
            out.append(t)
    return out


PROFILED_STEPS = 3
# Profile entries by kind, first match wins: kernel names on a GPU, aten ops on a CPU.
OP_CATEGORIES = (
    ("attention", r"attention|attn|flash|fmha|sdpa"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|cublas|aten::(mm|addmm|bmm|matmul|linear)\b"),
    ("layer_norm", r"layer_?norm"),
    ("gelu", r"gelu"),
    ("cross_entropy", r"softmax|nll_loss|cross_entropy"),
    ("optimizer", r"adam|sumsq|multi_tensor|optimizer"),
    ("masking", r"mask_tokens|philox|bernoulli|masked_fill|masked_scatter"),
    ("dropout", r"dropout"),
    ("embedding", r"embedding|index_select|index_add|gather|scatter"),
    ("copy", r"memcpy|memset|copy_|\bto\b|contiguous|clone"),
    ("other", r""),
)


def profile_step(setting: Setting, device, args, name="rf-fused", top: int = 15) -> dict:
    """Where one contender's step spends its time: per-op shares of device (or CPU) self time."""
    from torch.profiler import ProfilerActivity, profile

    run = build(name, setting, device, args)
    try:
        warm_up(run.step, device, max(1, args.warmup))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(PROFILED_STEPS):
                run.step()
            synchronize(device)
    finally:
        run.close()
    on_gpu = device.type == "cuda"
    timed = [(e.key, _self_time(e, on_gpu)) for e in prof.key_averages()]
    timed = sorted(((k, t) for k, t in timed if t > 0), key=lambda kv: -kv[1])
    total = sum(t for _, t in timed) or 1.0
    categories = {}
    for key, t in timed:
        kind = next(c for c, pattern in OP_CATEGORIES if re.search(pattern, key, re.IGNORECASE))
        categories[kind] = categories.get(kind, 0.0) + t / total
    return {"contender": name, "setting": setting.key, "clock": "device" if on_gpu else "cpu",
            "total_ms_per_step": total / 1e3 / PROFILED_STEPS,
            "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
            "ops": [{"name": k[:120], "share": t / total, "ms_per_step": t / 1e3 / PROFILED_STEPS}
                    for k, t in timed[:top]]}


def _self_time(event, on_gpu: bool) -> float:
    """Microseconds an event itself took: on a GPU only kernels and copies count (the CPU op
    that launched a kernel and a GPU annotation around it would count it twice)."""
    if not on_gpu:
        return event.self_cpu_time_total
    if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
        return 0.0
    return event.device_time_total


def device_name(device) -> str:
    return bc.device_facts(device)["name"]


def environment(device) -> dict:
    """_common's record of device, commit, date and versions, plus transformers and the driver."""
    env = bc.environment(device)
    try:
        import transformers

        env["versions"]["transformers"] = transformers.__version__
    except ImportError:
        env["versions"]["transformers"] = None
    if device.type == "cuda":
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            env["device"]["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, subprocess.SubprocessError, IndexError):
            env["device"]["driver"] = None
    return env


def write_report(path: Path, report: dict) -> None:
    """The report as JSON, in _common's layout ({"environment", ..., "results"}), atomically."""
    extra = {k: v for k, v in report.items() if k not in ("environment", "results")}
    bc.write_json(str(path), report["environment"], report["results"], **extra)


# ------------------------------------------------------------------ output
def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _percent(fraction) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.1f}%"


def format_table(rows: list[dict]) -> str:
    """The terminal table: one line per setting and contender, ratios to the HF peers."""
    head = ("setting", "batch", "contender", "ms/step", "tokens/s", "seq/s", "MFU", "peak GiB",
            "x hf-eager", "x hf-compile")
    lines = [head]
    for r in rows:
        setting = f"{r['model']}/seq{r['seq_len']}/{r['dtype']}"
        if r["status"] != "ok":
            lines.append((setting, str(r["batch"]), r["contender"], f"{r['status']}: {r['reason']}"))
            continue
        lines.append((setting, str(r["batch"]), r["contender"], _fmt(r["ms_per_step"], ".1f"),
                      _fmt(r["tokens_per_s"], ",.0f"), _fmt(r["sequences_per_s"], ",.1f"),
                      _percent(r["mfu"]),
                      _fmt(r["peak_memory_gib"], ".1f", "n/a"),
                      _fmt(r["vs_hf_eager"], ".2f"), _fmt(r["vs_hf_compile"], ".2f")))
    # the first three columns line up over every row; the figures over the ok rows
    widths = [max(len(line[i]) for line in lines if i < 3 or len(line) == len(head)) for i in range(len(head))]
    out = []
    for line in lines:
        if len(line) == len(head):
            out.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        else:  # skipped / failed: the reason runs to the end of the line
            out.append("  ".join(c.ljust(w) for c, w in zip(line[:3], widths)) + "  " + line[3])
    return "\n".join(out)


def format_targets(targets: list[dict]) -> str:
    lines = []
    for t in targets:
        what = f"{t['model']}/seq{t['seq_len']}/{t['dtype']} {t['metric']} >= {t['target']:g}"
        if t["status"] == "not evaluated":
            lines.append(f"  {what}: not evaluated ({t['reason']})")
        else:
            lines.append(f"  {what}: {t['status']} (achieved {t['achieved']:.3f}"
                         + (f", short by {t['shortfall']:.3f}" if t["status"] == "missed" else "") + ")")
    return "\n".join(lines)


def compare(old: dict, new: dict) -> str:
    """tokens/s of each (setting, contender) in `new` against `old`, with the change."""
    notes = []
    old_name = old.get("environment", {}).get("device", {}).get("name")
    new_name = new["environment"]["device"]["name"]
    if old_name != new_name:
        notes.append(f"note: devices differ ({old_name} vs {new_name}); "
                     "ratios across devices mix hardware and software changes")
    before = {(r["model"], r["seq_len"], r["dtype"], r["contender"]): r for r in old.get("results", [])}
    lines = [f"{'setting':<22} {'contender':<13} {'old tok/s':>12} {'new tok/s':>12} {'change':>8}"]
    for r in new["results"]:
        key = (r["model"], r["seq_len"], r["dtype"], r["contender"])
        o = before.get(key)
        old_tps = o.get("tokens_per_s") if o and o.get("status") == "ok" else None
        new_tps = r.get("tokens_per_s") if r["status"] == "ok" else None
        change = f"{100 * (new_tps / old_tps - 1):+.1f}%" if old_tps and new_tps else "-"
        lines.append(f"{r['model'] + '/seq' + str(r['seq_len']) + '/' + r['dtype']:<22} {r['contender']:<13} "
                     f"{_fmt(old_tps, ',.0f'):>12} {_fmt(new_tps, ',.0f'):>12} {change:>8}")
    return "\n".join(notes + lines)


# -------------------------------------------------------------- verification
def verification(gate_path: Path | None, env: dict) -> dict:
    """Whether this run's figures are verified: benchmarks/gpu_gate.py's correctness gate passed
    on the same device and commit (gpu_session.sh runs the gate and this run in one call and
    gives --gate; its output folder is emptied at the start of each call). A figure that is
    not verified is kept, marked with the reason."""
    def unverified(reason):
        return {"verified": False, "reason": reason}

    if gate_path is None:
        return unverified("no correctness gate was given (--gate)")
    try:
        gate = json.loads(Path(gate_path).read_text())
    except FileNotFoundError:
        return unverified(f"the correctness gate did not run ({Path(gate_path).name} is missing)")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return unverified(f"the gate file {Path(gate_path).name} is unreadable ({type(err).__name__})")
    if not isinstance(gate, dict) or gate.get("schema") != GATE_SCHEMA:
        return unverified(f"{Path(gate_path).name} is not a gpu_gate.py report ({GATE_SCHEMA})")
    gate_env = gate.get("environment", {})
    for what in ("name", "type"):
        if gate_env.get("device", {}).get(what) != env["device"][what]:
            return unverified(f"the gate ran on {gate_env.get('device', {}).get(what)!r}, "
                              f"this run on {env['device'][what]!r}")
    if gate_env.get("commit") != env["commit"]:
        return unverified(f"the gate ran on commit {gate_env.get('commit')}, this run on {env['commit']}")
    summary = {"gate": Path(gate_path).name, "gate_date": gate_env.get("date"), "setting": gate.get("setting"),
               "worst_error_over_allowed": gate.get("worst_error_over_allowed"),
               "cuda_tests_passed": gate.get("tests", {}).get("passed")}
    if gate.get("passed") is not True:
        failures = gate.get("failures") or ["no reason recorded"]
        return {**unverified("the correctness gate failed: " + "; ".join(map(str, failures[:3]))[:300]),
                **summary}
    return {"verified": True, **summary}


# ------------------------------------------------------------------ record
TABLE_START, TABLE_END = "<!-- latest-runs:start -->", "<!-- latest-runs:end -->"


def _latest_per_device(paths) -> dict:
    """{(device name, group): (data, file name)} of the newest GPU report per device and group,
    where group is the part of the file name before the device (e.g. "throughput", "bench_attention")."""
    latest = {}
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        env = data.get("environment", {}) if isinstance(data, dict) else {}
        if env.get("device", {}).get("type") != "cuda" or "date" not in env:
            continue
        key = (env["device"]["name"], path.name.split("-")[0])
        if key not in latest or env["date"] > latest[key][0]["environment"]["date"]:
            latest[key] = (data, path.name)
    return latest


def record_table(results_dir: Path) -> str:
    """Markdown tables of the latest GPU run per device in `results_dir`: throughput figures,
    then the kernel benchmarks' files (`bench_<op>-<device>-<date>.json`)."""
    runs = _latest_per_device(sorted(results_dir.glob("throughput-*.json")))
    runs = {k: v for k, v in runs.items() if v[0].get("schema") == SCHEMA}
    kernels = _latest_per_device(sorted(results_dir.glob("bench_*-*.json")))
    if not runs and not kernels:
        return "No GPU run recorded yet."
    lines = []
    if runs:
        lines += ["| device | date | commit | setting | batch | contender | tokens/s | MFU | x hf-eager | x hf-compile "
                  "| verified | file |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (name, _), (data, fname) in sorted(runs.items()):
        env = data["environment"]
        verified = verified_cell(data)
        for r in data["results"]:
            if r["status"] != "ok":
                cells = [r["status"] + ": " + r.get("reason", "")[:60], "", "", ""]
            else:
                cells = [f"{r['tokens_per_s']:,.0f}", _percent(r["mfu"]),
                         _fmt(r.get("vs_hf_eager"), ".2f"), _fmt(r.get("vs_hf_compile"), ".2f")]
            lines.append(f"| {name} | {env['date'][:10]} | {env['commit'][:8]} | "
                         f"{r['model']}/seq{r['seq_len']}/{r['dtype']} | {r['batch']} | {r['contender']} | "
                         + " | ".join(cells) + f" | {verified} | {fname} |")
    if kernels:
        lines += ["", "| kernel benchmark | device | date | commit | file |", "|---|---|---|---|---|"]
        for (name, bench), (data, fname) in sorted(kernels.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            env = data["environment"]
            lines.append(f"| {bench} | {name} | {env['date'][:10]} | {env['commit'][:8]} | {fname} |")
    return "\n".join(lines).strip()


def verified_cell(report: dict) -> str:
    """The record table's `verified` cell: yes, or why not (a run recorded before the gate existed:
    not checked)."""
    v = report.get("verification")
    if v is None:
        return "not checked"
    return "yes" if v.get("verified") else "**no**: " + v.get("reason", "")[:80].replace("|", "/")


def update_record_readme(results_dir: Path) -> None:
    """Rewrite the table between the markers of results_dir/README.md (atomically)."""
    readme = results_dir / "README.md"
    text = readme.read_text()
    if TABLE_START not in text or TABLE_END not in text:
        raise ValueError(f"{readme} lacks the markers {TABLE_START} / {TABLE_END} around its table")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    text = f"{head}{TABLE_START}\n{record_table(results_dir)}\n{TABLE_END}{tail}"
    atomic_write(readme, lambda tmp: tmp.write_text(text))


def record_path(report: dict, prefix: str = "throughput", results_dir: Path = RESULTS_DIR) -> Path:
    """results_dir/<prefix>-<device>-<UTC date and time>.json for a report with an environment."""
    env = report["environment"]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", env["device"]["name"]).strip("-").lower()
    stamp = env["date"].replace(":", "").replace("-", "")[:15]
    return results_dir / f"{prefix}-{slug}-{stamp}.json"


SESSION_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.(json|png|svg)")


def import_session(archive: Path, results_dir: Path = RESULTS_DIR) -> list[str]:
    """Copy the GPU reports of one `gpu_session.sh` STAGE.tgz into results_dir under record names.

    Kept: throughput reports (with their chart), the kernel benchmarks' (`bench_*.json`) and the
    correctness gate's (`gate-*.json`), from a CUDA device; the rest (logs, CPU dry runs, files
    without an environment) stays in the archive. Members are read, never extracted, so no path
    in the archive can write outside results_dir; a file already there with the same bytes is
    left as it is. Returns one line per member saying what happened to it.
    """
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = {Path(m.name).name: tar.extractfile(m).read() for m in tar.getmembers()
                       if m.isfile() and SESSION_FILE.fullmatch(Path(m.name).name)}
    except (OSError, tarfile.TarError, EOFError) as err:
        raise SystemExit(f"error: {archive} is not a gpu_session.sh STAGE.tgz ({err}); pass the .tgz files "
                         "the GPU session returned")
    done = []
    for name, data in sorted(members.items()):
        if not name.endswith(".json"):
            continue
        try:
            report = json.loads(data)
            env = report["environment"]
            is_gpu = env["device"]["type"] == "cuda"
        except (ValueError, KeyError, TypeError):
            done.append(f"{name}: kept in the archive only (not a report with an environment)")
            continue
        if not is_gpu:
            done.append(f"{name}: kept in the archive only (not a GPU run)")
            continue
        if report.get("schema") == SCHEMA:
            prefix = "throughput"
        elif report.get("schema") == GATE_SCHEMA:
            prefix = "gate"
        elif name.startswith("bench_"):
            prefix = Path(name).stem.split("-")[0]
        else:
            done.append(f"{name}: kept in the archive only (not a throughput, gate or kernel report)")
            continue
        dest = record_path(report, prefix, results_dir)
        copies = [(data, dest)]
        if prefix == "throughput":  # its chart, under the same name
            copies += [(members[chart], dest.with_suffix(suffix)) for suffix in (".png", ".svg")
                       if (chart := Path(name).stem + suffix) in members]
        for payload, path in copies:
            if path.exists() and path.read_bytes() == payload:
                done.append(f"{name}: {path.name} is already in the record")
                continue
            if path.exists():  # same device and second, different bytes: keep both
                path = path.with_name(f"{path.stem}-{archive.stem}{path.suffix}")
            atomic_write(path, lambda tmp, payload=payload: tmp.write_bytes(payload))
            done.append(f"{name}: recorded as {path.name}")
    return done


# -------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny preset, seq 64, batch 4, --precision auto's dtype (fp32 on a CPU, bf16 on sm_80+, fp16 below), "
                        "3 timed steps")
    p.add_argument("--models", nargs="+", default=None, choices=("tiny", "base", "large"))
    p.add_argument("--seq-lens", nargs="+", type=int, default=None)
    p.add_argument("--dtypes", nargs="+", default=None, choices=tuple(DTYPES),
                   help="default: bf16 and fp16 on sm_80+ GPUs, fp16 on older ones (V100, T4: no native bf16)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the largest that fits)")
    p.add_argument("--max-tokens", type=int, default=1 << 17, help="upper bound of the batch search, in tokens")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; quick 1)")
    p.add_argument("--steps", type=int, default=None, help="steps per timed block (default 10; quick 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed blocks; the median is reported (default 5; quick 3)")
    p.add_argument("--skip-compile", action="store_true", help="report hf-compile as skipped (compiling is slow on a CPU)")
    p.add_argument("--interpret", action="store_true",
                   help="on a CPU, time rf-fused in Triton's interpreter instead of skipping it")
    p.add_argument("--profile", action="store_true",
                   help="profile rf-fused's step per setting (done anyway on a GPU when a target is missed)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--chart", type=Path, default=None, help="bar chart of tokens/s (PNG; SVG without matplotlib)")
    p.add_argument("--compare", type=Path, default=None, help="a previous --json file to compare against")
    p.add_argument("--no-record", action="store_true", help="on a GPU, do not record the run in benchmarks/results/")
    p.add_argument("--refresh-record", nargs="*", type=Path, metavar="STAGE.tgz", default=None,
                   help="only refresh the record: copy the reports in these gpu_session.sh archives (if any) "
                        "into benchmarks/results/, then rebuild the table in its README.md")
    p.add_argument("--gate", type=Path, default=None,
                   help="gpu_gate.py's JSON from the same session: the figures are marked verified only if it "
                        "passed on this device and commit (otherwise kept and marked unverified)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when present)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed contenders")
    args = p.parse_args(argv)
    for name in ("batch", "max_tokens", "warmup", "steps", "repeats"):
        value = getattr(args, name)
        if value is not None and (value < (0 if name == "warmup" else 1)):
            p.error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'warmup' else 'positive'}, got {value}")
    if args.seq_lens is not None and min(args.seq_lens) < 8:
        p.error(f"--seq-lens must be at least 8 tokens each, got {args.seq_lens}")
    if args.compare is not None and not args.compare.is_file():
        p.error(f"--compare: no such file {args.compare}")
    missing = [str(a) for a in args.refresh_record or [] if not a.is_file()]
    if missing:
        p.error(f"--refresh-record: no such file {', '.join(missing)}")
    if args.device is not None:
        try:
            kind = torch.device(args.device).type
        except RuntimeError:
            kind = None
        if kind not in ("cpu", "cuda"):
            p.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    return args


def settings_from(args, device) -> list[tuple[str, int, str]]:
    """(model, seq_len, dtype) triples to run, from the flags and the mode's defaults."""
    from roberta_fast.precision import native_bf16, resolve_precision  # not torch.cuda.is_bf16_supported()

    auto = resolve_precision("auto", device)  # bf16 on sm_80+, fp16 on a V100/T4, fp32 on the CPU
    if args.quick:
        models, seqs = args.models or ["tiny"], args.seq_lens or [64]
        dtypes = args.dtypes or [auto]
    else:
        models, seqs = args.models or ["base", "large"], args.seq_lens or [128, 512]
        dtypes = args.dtypes or (["bf16", "fp16"] if auto == "bf16" else [auto])
    for model in models:
        limit = model_config(model).max_seq_len
        bad = [s for s in seqs if s > limit]
        if bad:
            raise SystemExit(f"error: --seq-lens {bad} exceed the {model} preset's {limit} positions")
    if device.type == "cuda" and "bf16" in dtypes and not native_bf16(device):
        raise SystemExit("error: this GPU has no native bf16 (below sm_80); pass --dtypes fp16")
    return [(m, s, d) for m in models for s in seqs for d in dtypes]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.refresh_record is not None:
        for archive in args.refresh_record:
            print(f"{archive}:")
            for line in import_session(archive):
                print(f"  {line}")
        update_record_readme(RESULTS_DIR)
        print(f"updated {RESULTS_DIR.relative_to(ROOT)}/README.md")
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda needs a CUDA GPU, and torch sees none")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # CUDA events (and Triton launches) use the current device: GPU N, not 0
    quick = args.quick
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 5)
    args.steps = args.steps or (1 if quick else 10)
    args.repeats = args.repeats or (3 if quick else 5)
    batch = args.batch or (4 if quick else None)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 work (the optimizer, losses) as trainers run it
        torch.backends.cudnn.allow_tf32 = True

    report = {"schema": SCHEMA, "environment": environment(device),
              "config": {"quick": quick, "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats,
                         "mlm_probability": MLM_PROBABILITY, "contenders": args.contenders,
                         "timing": "median over repeats of (block time / steps); CUDA events on a GPU"},
              "results": [], "batch_choice": {}, "targets": [], "profiles": [], "complete": False}
    env = report["environment"]
    report["verification"] = verification(args.gate, env)
    print("figures verified by the correctness gate" if report["verification"]["verified"]
          else f"figures NOT verified: {report['verification']['reason']}")
    print(f"device: {env['device']['name']}  torch {torch.__version__}  commit {env['commit'][:12]}")
    for model, seq_len, dtype in settings_from(args, device):
        if batch is None:
            b, why = find_batch(model, seq_len, dtype, device, args, args.contenders)
        else:
            b, why = batch, "given" if args.batch else "--quick default"
        setting = Setting(model, seq_len, dtype, b)
        report["batch_choice"][setting.key] = {"batch": b, "how": why}
        for name in args.contenders:
            row = measure(name, setting, device, args)
            report["results"].append(row)
            if args.json is not None:  # after every contender: a run cut off keeps what it measured
                write_report(args.json, report)
            status = f"{row['ms_per_step']:.1f} ms/step" if row["status"] == "ok" else f"{row['status']}: {row['reason']}"
            print(f"  {setting.key} batch {b} {name}: {status}", flush=True)
    add_ratios(report["results"])
    report["targets"] = evaluate_targets(report["results"], device)
    if args.json is not None:  # the ratios and targets too, before the (optional) profiles
        write_report(args.json, report)

    missed = {(t["model"], t["seq_len"], t["dtype"]) for t in report["targets"] if t["status"] == "missed"}
    for r in report["results"]:
        key = (r["model"], r["seq_len"], r["dtype"])
        if r["contender"] == "rf-fused" and r["status"] == "ok" and (args.profile or key in missed):
            try:
                report["profiles"].append(profile_step(Setting(*key, r["batch"]), device, args))
            except Exception as err:  # a profile is extra: report it, keep the figures
                report["profiles"].append({"setting": "/".join(map(str, key)), "error": f"{type(err).__name__}: {err}"})

    print()
    print(format_table(report["results"]))
    v = report["verification"]
    print("verified: yes (" + v["gate"] + ")" if v["verified"] else f"verified: NO ({v['reason']})")
    if report["targets"]:
        print("\ntargets (rf-fused):")
        print(format_targets(report["targets"]))
    for prof in report["profiles"]:
        if "ops" in prof:
            print(f"\nwhere rf-fused's step goes, {prof['setting']} ({prof['clock']} time, "
                  f"{prof['total_ms_per_step']:.1f} ms/step):")
            print("  by kind: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in prof["categories"].items()))
            for op in prof["ops"]:
                print(f"  {100 * op['share']:5.1f}%  {op['name']}")
    if args.compare is not None:
        print(f"\ncompared with {args.compare}:")
        print(compare(json.loads(args.compare.read_text()), report))

    report["complete"] = True
    if args.json is not None:
        write_report(args.json, report)
        print(f"\nwrote {args.json}")
    if device.type == "cuda" and not quick and not args.no_record:
        path = record_path(report)
        write_report(path, report)
        update_record_readme(RESULTS_DIR)
        print(f"recorded {path.relative_to(ROOT)} and updated {RESULTS_DIR.relative_to(ROOT)}/README.md")
        print(throughput_chart(report, path.with_suffix(".png")))
    if args.chart is not None:
        print(throughput_chart(report, args.chart))
    return 0


if __name__ == "__main__":
    sys.exit(main())
