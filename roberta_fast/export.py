"""`python -m roberta_fast.export CHECKPOINT --out DIR`: any training checkpoint as a Hugging Face model.

    python -m roberta_fast.export runs/base/checkpoints/step_00020000.pt --out base-20k/
    python -m roberta_fast.export runs/base --out base-latest/     # the run's latest checkpoint

A `step_N.pt` of `python -m roberta_fast.train` becomes the same directory as the run's
final export (config.json, model.safetensors and the tokenizer), which `transformers`
and `rf.RobertaForMaskedLM.from_pretrained` load; one of `python -m roberta_fast.finetune`
becomes its sequence classifier. The checkpoint is read with weights_only=True (nothing
in it can run code), the model is rebuilt from the config the checkpoint records, and
the tokenizer is the run's: the dataset's for pretraining (as recorded in the checkpoint's
training config), the fine-tuned model's for fine-tuning; --tokenizer names another. A
tokenizer the model was not trained with is refused: a checkpoint records the hash of its
tokenizer (the dataset's for pretraining, the model's for fine-tuning; in older checkpoints, which
do not, the vocabulary size is compared).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .checkpoint import DiskSpaceError, load_checkpoint
from .config import RobertaConfig
from .model import RobertaForMaskedLM
from .sbo import RobertaForSpanBERT
from .trainer import check_export_target, export_pretrained


def run_tokenizer(state: dict):
    """The tokenizer of the run that wrote `state`: the starting model's directory (or its --tokenizer)
    for fine-tuning; for pretraining the dataset's, checked against its manifest (ValueError naming
    --tokenizer if it is gone or damaged)."""
    cfg = state["config"]
    recorded = (cfg.get("tokenizer") or cfg.get("model")) if "labels" in state else cfg.get("data")
    if recorded is not None and not isinstance(recorded, str):
        raise ValueError(f"the checkpoint's training config names its tokenizer as {recorded!r}, not a path: pass "
                         "--tokenizer, the tokenizer the run used")
    if "labels" in state:
        if not recorded:
            raise ValueError("the checkpoint's training config names no model or tokenizer: pass --tokenizer, the "
                             "tokenizer of the model the run fine-tuned")
        return recorded
    from .data import dataset_tokenizer

    if not recorded:  # the embedded demonstration corpus (cached; rebuilt the same way if it is not)
        from .corpus import default_dataset

        return dataset_tokenizer(default_dataset())
    try:
        return dataset_tokenizer(cfg["data"])
    except ValueError as err:
        relative = "" if Path(cfg["data"]).is_absolute() else (
            f"; the checkpoint recorded {cfg['data']!r} relative to the directory the run was started in: run the "
            "export from there, or")
        raise ValueError(f"the run's dataset is not readable here ({err}){relative or ';'} pass --tokenizer, the "
                         "tokenizer directory the dataset was made with") from None


def check_tokenizer(state: dict, model, tokenizer, source: str):
    """`tokenizer` (a RobertaTokenizer, directory or Hub name) loaded, or ValueError if the checkpoint's
    model was not trained on its ids: the export would pair the model with another tokenizer.
    Checkpoints record the tokenizer's hash; older ones are checked
    by size (a fine-tuned model's vocabulary may be padded beyond its tokenizer's)."""
    from .tokenizer import RobertaTokenizer

    if not isinstance(tokenizer, RobertaTokenizer):
        tokenizer = RobertaTokenizer.from_pretrained(tokenizer)
    fix = "pass --tokenizer with the tokenizer the run's dataset was made with"
    trained = state.get("tokenizer_hash")
    if trained is not None and tokenizer.tokenizer_hash != trained:
        raise ValueError(f"{source} is tokenizer {tokenizer.tokenizer_hash[:12]}, but the checkpoint was trained on "
                         f"ids of tokenizer {trained[:12]}: the export would pair the model with a tokenizer it was "
                         f"not trained with; {fix}")
    vocab, ids = model.config.vocab_size, tokenizer.vocab_size
    if ids > vocab or ("labels" not in state and ids != vocab):
        raise ValueError(f"{source} has {ids} ids, but the checkpoint's model has vocab_size {vocab}: it was not "
                         f"trained with that tokenizer; {fix}")
    return tokenizer


def model_from_checkpoint(state: dict):
    """The model whose weights `state` holds: RobertaForMaskedLM (pretraining),
    RobertaForSpanBERT (pretraining with the SBO) or the fine-tuning task's model
    (RobertaForSequenceClassification, ...ForTokenClassification, ...), on the reference backend."""
    if "model_config" not in state:
        raise ValueError("the checkpoint records no model config (a fine-tuning checkpoint written before "
                         "roberta_fast.export existed); export the run's best epoch from its model/ directory")
    config = RobertaConfig.from_dict(state["model_config"])
    if "labels" in state:  # fine-tuning: the task's model (checkpoints before --task: classify)
        from .tasks import TASKS

        task = state.get("task", "classify")
        if task not in TASKS:
            raise ValueError(f"the checkpoint is of fine-tuning task {task!r}, which this roberta_fast does not "
                             f"have (it has {', '.join(TASKS)}): export it with the version that wrote it")
        cls = TASKS[task].model_class
    elif any(key.startswith("sbo.") for key in state["model"]):  # --objective mlm+sbo: sbo.safetensors too
        cls = RobertaForSpanBERT
    else:
        cls = RobertaForMaskedLM
    model = cls(config, backend="reference")
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if missing or unexpected:
        named = ", ".join(f"{what} {keys[:4]}{' ...' if len(keys) > 4 else ''}"
                          for what, keys in (("lacks", missing), ("has extra", unexpected)) if keys)
        raise ValueError(f"the checkpoint's model {named} for a {cls.__name__} of its config: written by another "
                         "roberta_fast version, or edited? Export it with the version that wrote it")
    return model.eval()


def export_checkpoint(checkpoint, out, tokenizer=None, trust: bool = False) -> dict:
    """Write the checkpoint at `checkpoint` (a file, a checkpoints directory or a run directory:
    its latest) as an HF directory `out`; returns the loaded checkpoint state."""
    check_export_target(out)  # before the checkpoint is read: an --out the export would wipe is refused
    checkpoint = Path(checkpoint)
    if (checkpoint / "checkpoints").is_dir():  # a run directory
        checkpoint = checkpoint / "checkpoints"
    state = load_checkpoint(checkpoint, trust=trust)
    if "model" not in state or "config" not in state:
        raise ValueError(f"{str(checkpoint)!r} is not a checkpoint of roberta_fast.train or roberta_fast.finetune")
    model = model_from_checkpoint(state)
    source = f"--tokenizer {tokenizer!r}" if tokenizer else \
        f"the tokenizer of the run's {'model' if 'labels' in state else 'dataset'}"
    export_pretrained(model, check_tokenizer(state, model, tokenizer or run_tokenizer(state), source), out)
    if "labels" in state:  # a fine-tuning task's own touches (token: the tokenizer's prefix space)
        from .tasks import TASKS

        TASKS[state.get("task", "classify")].after_export(out)
    return state


def build_parser() -> argparse.ArgumentParser:
    """The CLI of `python -m roberta_fast.export`."""
    p = argparse.ArgumentParser(prog="python -m roberta_fast.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a step_N.pt of roberta_fast.train or roberta_fast.finetune, or a run "
                                      "(or checkpoints) directory for its latest one")
    p.add_argument("--out", required=True, help="directory for the Hugging Face model: new, empty or an earlier "
                                                "export, which is replaced atomically")
    p.add_argument("--tokenizer", help="tokenizer directory or Hub name (default: the run's own, as recorded "
                                       "in the checkpoint)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="read an old-format checkpoint with the full unpickler, which can run code: only for "
                        "files you wrote yourself (default: weights_only=True loading)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        state = export_checkpoint(args.checkpoint, args.out, args.tokenizer, trust=args.trust_checkpoint)
    except (ValueError, FileNotFoundError) as err:  # FileNotFoundError: a tokenizer that is not there
        print(f"error: {err}", file=sys.stderr)
        return 2
    except DiskSpaceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"exported step {state['step']} of {args.checkpoint} (Hugging Face format) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
