"""`python -m roberta_fast.train`: pretrain RoBERTa with the MLM objective (docs/training.md).

    python -m roberta_fast.train                          # tiny preset, embedded corpus, ./runs/tiny
    python -m roberta_fast.train --preset base --data DATADIR --out runs/base
    torchrun --nproc_per_node 8 -m roberta_fast.train --preset base --data DATADIR

A thin entry point: the config (roberta_fast.train_config), then the Trainer
(roberta_fast.trainer) does the rest. A bad config, dataset, --init-from or output
directory (or another trainer already writing to it) exits with status 2 and one message
before any training; a run that cannot save a checkpoint for lack of disk space, or whose
losses stay non-finite, exits with status 1; an interrupted run (SIGTERM, Ctrl-C)
saves a checkpoint, exits with 128 + the signal's number (143 for SIGTERM, 130 for
SIGINT, as a shell reports a process killed by it) and resumes when the same command is
run again.
"""
from __future__ import annotations

import os
import sys


def report(err: Exception, every_rank: bool, prefix: str = "error") -> None:
    """One `error:` line. Under torchrun a mistake in the config, data or checkpoint fails every rank
    alike: rank 0 says it (once, not once per process); other failures name their rank."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        print(f"{prefix}: {err}", file=sys.stderr)
    elif every_rank or rank == 0:
        print(f"{prefix}: [rank {rank}] {err}", file=sys.stderr)


def out_of_memory_advice(cfg, trainer) -> str:
    """What to change when a step does not fit in the GPU's memory: a smaller micro-batch with the
    same global batch (more accumulation steps, the same optimizer steps: the rerun resumes from
    the last checkpoint), activation checkpointing, then shorter sequences."""
    ways = []
    if cfg.batch_size > 1:  # the largest divisor of it up to its half, so the global batch still divides
        smaller = max(d for d in range(1, cfg.batch_size // 2 + 1) if cfg.batch_size % d == 0)
        accum = trainer.grad_accum * cfg.batch_size // smaller
        ways.append(f"--batch-size {smaller} --grad-accum {accum} (the same {trainer.global_batch} sequences per "
                    "optimizer step; the rerun resumes from the last checkpoint)")
    if not cfg.activation_checkpointing:
        ways.append("--activation-checkpointing (less activation memory, about a third more compute)")
    if not ways:
        ways.append("a smaller --seq-len or model")
    return (f"A micro-batch of {cfg.batch_size} sequences of {cfg.seq_len} tokens does not fit in memory: rerun "
            f"with {', or '.join(ways)}.")


def main(argv=None) -> int:
    import torch

    from .train_config import load_config
    from .trainer import PeerFailed, Trainer

    try:
        cfg = load_config(argv)
        trainer = Trainer(cfg)
    except ValueError as err:
        report(err, every_rank=False)
        return 2
    except PeerFailed as err:  # rank 0 could not start (its error says why)
        report(err, every_rank=False)
        return 1
    try:
        summary = trainer.run()
    except ValueError as err:  # e.g. a checkpoint that does not match the config
        report(err, every_rank=False)
        return 2
    except PeerFailed as err:  # another process failed and said why; rank 0 adds a line if it is a survivor
        report(err, every_rank=False)
        return 1
    except torch.OutOfMemoryError as err:  # (a RuntimeError) name the flags that fit the step in memory
        report(RuntimeError(f"{str(err).strip()} {out_of_memory_advice(cfg, trainer)}"), every_rank=True)
        return 1
    except RuntimeError as err:
        report(err, every_rank=True)
        return 1
    finally:
        trainer.close()
    return 128 + summary["signal"] if summary["signal"] else 0


if __name__ == "__main__":
    sys.exit(main())
