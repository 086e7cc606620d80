"""The trainer end to end on CPU: exact resume, loss falls + HF export, gradient
accumulation, DDP (gloo, 2 processes), fp16 overflow handling, early errors.

All runs share one small dataset (1 MB of the embedded corpus, vocab 1024) and use a
1-layer, hidden-32 model on 32-token sequences so the whole file stays fast.
"""
import json
import math
import os
import re
import shutil
import signal
import socket
import warnings

import pytest
import torch
import torch.multiprocessing as mp
from malicious_checkpoint import write_malicious_checkpoint

from roberta_fast.checkpoint import atomic_torch_save
from roberta_fast.metrics import read_metrics
from roberta_fast.train import main
from roberta_fast.train_config import TrainConfig, load_config
from roberta_fast.trainer import Trainer

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, seq_len=32,
             batch_size=4, max_steps=6, warmup_steps=2, lr=3e-3, log_every=1, eval_every=3, eval_batches=2,
             save_every=100, prefetch=2, progress=False, tensorboard=False, plot=False, device="cpu")


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    from roberta_fast.corpus import default_dataset

    return str(default_dataset(tmp_path_factory.mktemp("corpus"), vocab_size=1024, max_bytes=1_000_000))


def small_argv(dataset) -> list[str]:
    """The command line of SMALL (without --out)."""
    return ["--data", dataset, "--device", "cpu", "--hidden-size", "32", "--num-hidden-layers", "1",
            "--num-attention-heads", "2", "--intermediate-size", "64", "--seq-len", "32", "--batch-size", "4",
            "--max-steps", "6", "--warmup-steps", "2", "--lr", "3e-3", "--no-progress", "--no-tensorboard",
            "--no-plot"]


def small_config(dataset, out, **overrides) -> TrainConfig:
    return TrainConfig.preset("tiny", data=dataset, out=str(out), **{**SMALL, **overrides})


def train_losses(out):
    return [(r["step"], r["loss"]) for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == "train"]


def run(cfg, on_step=None):
    trainer = Trainer(cfg, log=lambda *a: None)
    try:
        return trainer, trainer.run(on_step=on_step)
    finally:
        trainer.close()


def test_resume_is_exact(dataset, tmp_path):
    """6 steps straight == 3 steps, SIGTERM, resume for 3: same losses and weights, bit for bit.

    Logged every 2 steps, so the line of step 4 averages steps 3 and 4 across the stop.
    """
    whole, _ = run(small_config(dataset, tmp_path / "whole", log_every=2))

    def interrupt(trainer):
        if trainer.step == 3:
            signal.raise_signal(signal.SIGTERM)

    first, summary = run(small_config(dataset, tmp_path / "split", log_every=2), on_step=interrupt)
    assert summary["status"].startswith("stopped by SIGTERM") and summary["step"] == 3
    assert summary["signal"] == signal.SIGTERM  # python -m roberta_fast.train exits 143
    assert (tmp_path / "split" / "checkpoints" / "step_00000003.pt").is_file()
    assert not (tmp_path / "split" / "final").exists()  # no export of an unfinished run
    resumed, summary = run(small_config(dataset, tmp_path / "split", log_every=2))
    assert summary["status"] == "finished" and summary["step"] == 6

    expected = train_losses(tmp_path / "whole")
    assert [s for s, _ in expected] == [2, 4, 6]
    assert train_losses(tmp_path / "split") == expected  # exact floats, as logged
    evals = lambda out: [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "eval"]  # noqa: E731
    assert evals(tmp_path / "split") == evals(tmp_path / "whole")
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.schedule.num_updates == whole.schedule.num_updates == 6


def test_stop_at_between_log_lines_logs_as_a_straight_run(dataset, tmp_path):
    """--stop-at 3 with --log-every 2: no extra line at step 3, and the line of step 4 averages
    steps 3 and 4 as the straight run's does."""
    run(small_config(dataset, tmp_path / "whole", log_every=2))
    run(small_config(dataset, tmp_path / "split", log_every=2, stop_at=3))
    run(small_config(dataset, tmp_path / "split", log_every=2))
    assert train_losses(tmp_path / "split") == train_losses(tmp_path / "whole")


def test_a_run_killed_before_its_first_checkpoint_logs_step_0_once(dataset, tmp_path):
    """Killed before any checkpoint, the rerun starts over and evaluates step 0 again: the history
    (read_metrics, the final report) holds that evaluation once, as a straight run's does."""
    def kill(trainer):
        if trainer.step == 2:
            raise KeyboardInterrupt  # as a SIGKILL: no checkpoint saved

    with pytest.raises(KeyboardInterrupt):
        run(small_config(dataset, tmp_path / "run"), on_step=kill)
    run(small_config(dataset, tmp_path / "run"))
    run(small_config(dataset, tmp_path / "whole"))
    history = lambda out: [(r["kind"], r["step"]) for r in read_metrics(out / "metrics.jsonl")]  # noqa: E731
    assert history(tmp_path / "run") == history(tmp_path / "whole")
    assert history(tmp_path / "run").count(("eval", 0)) == 1


def test_wandb_gets_the_runs_scalars_and_a_crash_marks_its_run_failed(dataset, tmp_path, monkeypatch):
    """--wandb-project: a run killed before its first checkpoint leaves its W&B run failed; the rerun
    (from scratch) starts a new W&B run with the run's options as its config, and logs what
    metrics.jsonl holds."""
    import sys

    from test_metrics import FakeWandb

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)

    def kill(trainer):
        if trainer.step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(small_config(dataset, tmp_path, wandb_project="rf"), on_step=kill)
    assert fake.finished == [1]
    fake.logged.clear()
    run(small_config(dataset, tmp_path, wandb_project="rf"))
    assert fake.finished == [1, 0] and fake.inits[1]["id"] is None
    assert fake.inits[1]["config"]["max_steps"] == 6 and fake.inits[1]["config"]["wandb_project"] == "rf"
    logged = {(step, key): value for step, data in fake.logged for key, value in data.items()}
    for record in read_metrics(tmp_path / "metrics.jsonl"):
        assert logged[(record["step"], f"{record['kind']}/loss")] == record["loss"]
    assert (6, "eval/loss") in logged and (6, "train/lr") in logged


def test_wandb_project_without_wandb_is_a_config_error_before_the_run(dataset, tmp_path, monkeypatch, capsys):
    """Exit 2 with one line naming the install, and nothing written to --out (was: a traceback, exit 1,
    after the run had set up)."""
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, whether or not it is installed
    assert main([*small_argv(dataset), "--out", str(tmp_path / "run"), "--wandb-project", "rf"]) == 2
    assert "--wandb-project rf needs the wandb package: pip install wandb" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_saves_and_exits_with_128_plus_the_signal(dataset, tmp_path, monkeypatch, capsys, sig):
    """Scripts and schedulers tell an interrupted run (checkpoint saved) from a finished one
    by its exit status: 130 for Ctrl-C, 143 for SIGTERM; rerunning the command finishes it."""
    step = Trainer.train_step

    def interrupted_step(self, micro_batches):
        if self.step == 2:
            signal.raise_signal(sig)  # during step 3, as a scheduler's SIGTERM or a Ctrl-C
        return step(self, micro_batches)

    monkeypatch.setattr(Trainer, "train_step", interrupted_step)
    argv = small_argv(dataset) + ["--out", str(tmp_path / "run")]
    assert main(argv) == 128 + sig
    assert f"stopped by {sig.name} at step 3" in capsys.readouterr().err
    assert (tmp_path / "run" / "checkpoints" / "step_00000003.pt").is_file()
    monkeypatch.setattr(Trainer, "train_step", step)
    assert main(argv) == 0 and (tmp_path / "run" / "final").is_dir()


def test_out_of_memory_names_the_flags_that_fit_and_the_rerun_with_them_resumes(dataset, tmp_path, monkeypatch,
                                                                               capsys):
    """A step that does not fit in the GPU's memory (torch.OutOfMemoryError, faked here) exits 1 with
    one line naming a smaller --batch-size with the --grad-accum that keeps the optimizer step's
    size; that rerun resumes from the last checkpoint and finishes."""
    step = Trainer.train_step

    def out_of_memory(self, micro_batches):
        if self.step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return step(self, micro_batches)

    monkeypatch.setattr(Trainer, "train_step", out_of_memory)
    argv = small_argv(dataset) + ["--out", str(tmp_path / "run"), "--save-every", "2", "--grad-accum", "2",
                                      "--log-every", "1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "CUDA out of memory. Tried to allocate 2.00 GiB." in err
    flags = re.search(r"rerun with --batch-size (\d+) --grad-accum (\d+) \(the same 8 sequences per optimizer "
                      r"step; the rerun resumes from the last checkpoint\), or --activation-checkpointing", err)
    assert flags and flags.groups() == ("2", "4"), err
    monkeypatch.setattr(Trainer, "train_step", step)
    assert main(argv + ["--batch-size", flags[1], "--grad-accum", flags[2]]) == 0
    out = capsys.readouterr()
    assert "step_00000002.pt" in out.out + out.err and (tmp_path / "run" / "final").is_dir()
    assert [s for s, _ in train_losses(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_for_the_metrics_exits_1_with_one_line(dataset, tmp_path, capsys):
    """The disk fills under --out (metrics.jsonl -> /dev/full): exit 1 and one error line, as for a
    checkpoint, not an OSError traceback (that once also came twice, from closing the log)."""
    (tmp_path / "run").mkdir()
    os.symlink("/dev/full", tmp_path / "run" / "metrics.jsonl")
    assert main(small_argv(dataset) + ["--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert f"error: no space left on the disk of {str(tmp_path / 'run')!r} (writing metrics.jsonl)" in err


def test_stop_at_says_where_it_stopped_and_the_checkpoint(dataset, tmp_path, capsys):
    """--stop-at ends (status 0) with one line, as a signal's stop does: the step, the checkpoint and
    how to go on (it once ended silently)."""
    argv = small_argv(dataset) + ["--out", str(tmp_path / "run")]
    assert main(argv + ["--stop-at", "3"]) == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000003.pt"
    assert (f"stopped at step 3 (--stop-at 3); checkpoint {checkpoint}; rerun with a later --stop-at, or without "
            "it, to go on") in capsys.readouterr().err


def test_resume_refuses_a_changed_lr_schedule(dataset, tmp_path, capsys):
    """Resuming with another --max-steps (or warmup, lr, min_lr) would start a new LR schedule
    mid-run (here the LR of update 3 jumps from 0.00225 to 0.0027): refused with the old and new
    values and the flag that accepts it; with --allow-schedule-change the run goes on, saying so."""
    run(small_config(dataset, tmp_path / "run", stop_at=3))
    argv = small_argv(dataset) + ["--out", str(tmp_path / "run")]
    assert main(argv + ["--max-steps", "12"]) == 2
    err = capsys.readouterr().err
    assert "another LR schedule (--max-steps 6 -> 12): resuming would start a new schedule mid-run" in err
    assert "the LR of update 3 goes from 0.00225 to 0.0027" in err and "--allow-schedule-change" in err
    assert main(argv + ["--lr", "1e-3", "--warmup-steps", "1"]) == 2
    assert "(--warmup-steps 2 -> 1, --lr 0.003 -> 0.001)" in capsys.readouterr().err
    assert main(argv + ["--max-steps", "2", "--stop-at", "2", "--allow-schedule-change"]) == 2
    assert "the checkpoint is at step 3, past --max-steps 2" in capsys.readouterr().err
    assert main(argv + ["--max-steps", "8", "--allow-schedule-change"]) == 0
    out = capsys.readouterr().out
    assert "note: --allow-schedule-change: continuing on a new LR schedule (--max-steps 6 -> 8)" in out
    assert train_losses(tmp_path / "run")[-1][0] == 8 and (tmp_path / "run" / "final").is_dir()


def test_a_resume_that_leaves_the_warmup_to_the_preset_keeps_the_checkpoints(dataset, tmp_path, capsys):
    """A command without --warmup-steps resumes on its checkpoint's warmup, saying so, rather than being
    refused: a run of `--max-steps 40` started when the tiny preset's 30 warmup steps were kept (now it
    warms up for 4) goes on with the same command after the upgrade."""
    argv = small_argv(dataset)
    at = argv.index("--warmup-steps")
    argv = argv[:at] + argv[at + 2:] + ["--out", str(tmp_path / "run"), "--max-steps", "40", "--log-every", "1"]
    assert main(argv + ["--warmup-steps", "30", "--stop-at", "2"]) == 0  # as the older code chose
    assert main(argv + ["--stop-at", "4"]) == 0
    assert "note: resuming on the checkpoint's 30 warmup steps (--warmup-steps not given; a new run of this " \
           "command warms up for 4)" in capsys.readouterr().out
    lr = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"}
    assert lr[4] == pytest.approx(3e-3 * 4 / 30)  # step 4 of a 30-step warmup (of a 4-step one: the peak)
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["warmup_steps"] == 30


def test_resume_trains_with_changed_optimizer_flags_and_says_so(dataset, tmp_path, capsys):
    """A resume with another --weight-decay (or betas, eps) trains with it, as the run's config then
    records (the checkpoint's optimizer groups once won silently); biases and LayerNorm keep no decay,
    and the same command resumes without a note."""
    run(small_config(dataset, tmp_path / "a", stop_at=3))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    argv = small_argv(dataset) + ["--stop-at", "4"]
    assert main(argv + ["--out", str(tmp_path / "a")]) == 0
    assert "note: the optimizer" not in capsys.readouterr().out
    assert main(argv + ["--out", str(tmp_path / "b"), "--weight-decay", "0.5", "--eps", "1e-8"]) == 0
    assert ("note: the optimizer goes on with this run's settings, not the checkpoint's: --weight-decay 0.01 -> 0.5, "
            "--eps 1e-06 -> 1e-08") in capsys.readouterr().out
    same, changed = (torch.load(tmp_path / x / "checkpoints" / "step_00000004.pt", weights_only=True) for x in "ab")
    assert [(g["weight_decay"], g["eps"]) for g in changed["optimizer"]["param_groups"]] == [(0.5, 1e-8), (0.0, 1e-8)]
    assert not torch.equal(same["model"]["roberta.embeddings.word_embeddings.weight"],
                           changed["model"]["roberta.embeddings.word_embeddings.weight"])


def test_rerunning_a_resume_path_command_goes_on_from_the_newer_checkpoint_in_out(dataset, tmp_path, capsys):
    """--resume PATH, stopped later, then the same command again: it resumes the newer checkpoint
    in --out, saying so, instead of rolling back to PATH and redoing the steps (as it once did,
    from the command and from train_config.json); the saved config resumes "auto"."""
    run(small_config(dataset, tmp_path / "src", stop_at=2))
    source = tmp_path / "src" / "checkpoints" / "step_00000002.pt"
    argv = small_argv(dataset) + ["--log-every", "1", "--out", str(tmp_path / "run"), "--resume", str(source)]
    assert main(argv + ["--stop-at", "4"]) == 0
    assert f"resumed from {source} at step 2" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["resume"] == "auto"
    assert main(argv) == 0
    out = capsys.readouterr().out
    newer = tmp_path / "run" / "checkpoints" / "step_00000004.pt"
    assert f"holds a newer checkpoint than --resume {source} (step 2) that a run resumed from it wrote: " \
           f"resuming from {newer} instead" in out
    assert f"resumed from {newer} at step 4" in out
    assert [s for s, _ in train_losses(tmp_path / "run")] == [3, 4, 5, 6]


def test_a_resume_path_back_to_an_earlier_checkpoint_of_the_run_rolls_back(dataset, tmp_path, capsys):
    """Rolling back past a loss spike: --resume PATH to an older checkpoint of the same --out, whose
    newer checkpoints were not written by a run resumed from PATH, resumes PATH as asked."""
    argv = small_argv(dataset) + ["--log-every", "1", "--save-every", "2", "--keep-checkpoints", "3",
                                  "--out", str(tmp_path / "run")]
    assert main(argv + ["--stop-at", "4"]) == 0
    older = tmp_path / "run" / "checkpoints" / "step_00000002.pt"
    assert main(argv + ["--resume", str(older), "--stop-at", "3"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {older} at step 2" in out and "set the abandoned checkpoint aside as step_00000004.pt" in out
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*.pt*") if "sha" not in p.name) == [
        "step_00000002.pt", "step_00000003.pt", "step_00000004.pt.abandoned"]
    assert main(argv) == 0  # --resume auto goes on from step 3 of the new line, not the abandoned step 4
    assert "resumed from" in (out := capsys.readouterr().out) and "step_00000003.pt at step 3" in out


def test_a_schedule_change_inside_the_shared_warmup_names_where_the_lr_changes():
    """Inside a warmup both schedules share, the next update's LR is the same: the message names
    the first update whose LR differs (it once read 'goes from 0.0004 to 0.0004')."""
    from roberta_fast.schedule import WarmupLinearDecay
    from roberta_fast.trainer import check_schedule

    saved = WarmupLinearDecay(1e-3, 10, 100)
    for _ in range(3):
        saved.step()
    with pytest.raises(ValueError, match=r"the LR is unchanged until update 11, where it goes from 0.000989 to "
                                         r"0.000995"):
        check_schedule(saved.state_dict(), WarmupLinearDecay(1e-3, 10, 200), {"total_steps": "--max-steps"},
                       False, print)


def test_the_readme_flow_trains_then_finetunes(dataset, tmp_path, monkeypatch):
    """The README's commands in order: `python -m roberta_fast.train` shortened by
    --max-steps below the tiny preset's warmup (on the small test corpus, not the embedded
    one), then its fine-tuning line on the export with no --max-len. The documented outputs
    appear: final/ and loss.png (matplotlib is part of the install), then runs/cls/model."""
    from roberta_fast import finetune

    monkeypatch.chdir(tmp_path)
    assert main(["--max-steps", "6", "--data", dataset, "--eval-batches", "1", "--no-progress"]) == 0
    assert (tmp_path / "runs/tiny/final/model.safetensors").is_file()
    assert (tmp_path / "runs/tiny/loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name, rows in (("train.csv", 24), ("dev.csv", 8)):
        lines = ["text,label"] + [f"{'a fine day' if i % 2 else 'a poor day'} number {i},{i % 2}" for i in range(rows)]
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    readme = "--model runs/tiny/final --train train.csv --valid dev.csv --out runs/cls".split()
    assert finetune.main(readme + ["--epochs", "1"]) == 0
    assert (tmp_path / "runs/cls/model/model.safetensors").is_file()


def test_the_final_export_outlasts_sigterm_and_removes_what_killed_exports_left(dataset, tmp_path, monkeypatch,
                                                                               capsys):
    """A kill during the final export left a model-sized `.final.XXXXXXXX` in --out each time: an export
    removes exactly those (temp_dir_for's names for it), but not while another export works beside it
    (roberta_fast.export holds no run lock). A SIGTERM during the final export lets it finish."""
    from roberta_fast import trainer as trainer_module

    out = tmp_path / "run"
    stale, kept = out / ".final.ab_12xyz", [out / ".final.keepme", out / ".final.abcdefghi", out / ".other.abcdefgh"]
    for d in [stale, *kept]:
        (d / "model.safetensors").parent.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 100)
    export = trainer_module.export_pretrained

    def sigterm_then_export(*args):
        signal.raise_signal(signal.SIGTERM)
        return export(*args)

    class Killed(Exception):
        pass

    def killed(*_):
        raise Killed  # what SIGTERM's default action (death) would do, without ending pytest

    monkeypatch.setattr(trainer_module, "export_pretrained", sigterm_then_export)
    previous = signal.signal(signal.SIGTERM, killed)
    try:
        trainer, summary = run(small_config(dataset, out))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert summary["status"] == "finished" and summary["signal"] is None
    assert "SIGTERM received: finishing the export of the final model first" in capsys.readouterr().err
    assert (out / "final" / "model.safetensors").is_file() and not stale.exists()
    assert all(d.is_dir() for d in kept) and sorted(p.name for p in out.glob(".final.*")) == [".final.abcdefghi",
                                                                                              ".final.keepme"]
    stale.mkdir()
    held = os.open(out, os.O_RDONLY)
    try:
        import fcntl

        fcntl.flock(held, fcntl.LOCK_SH)  # another export at work in --out: its directory is not stale
        export(trainer.model, trainer.tokenizer, out / "final")
        assert stale.is_dir()
    finally:
        os.close(held)
    export(trainer.model, trainer.tokenizer, out / "final")
    assert not stale.exists() and (out / "final" / "config.json").is_file()


def test_cli_run_loss_falls_and_export_matches_transformers(dataset, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    argv = ["--data", dataset, "--out", str(out), "--max-steps", "60", "--warmup-steps", "4", "--lr", "1e-2",
            "--hidden-size", "64", "--num-hidden-layers", "1", "--num-attention-heads", "2",
            "--intermediate-size", "128", "--seq-len", "32", "--batch-size", "8", "--eval-every", "60",
            "--eval-batches", "4", "--log-every", "10", "--device", "cpu", "--no-progress",
            "--no-tensorboard", "--no-plot"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "effective config:" in printed and "validation MLM loss: first" in printed
    assert "precision fp32 (--precision auto -> fp32 on the CPU (no CUDA GPU))" in printed  # what was chosen, and why
    assert "(attention: PyTorch SDPA (reference backend))" in printed
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["max_steps"] == 60 and saved["hidden_size"] == 64
    evals = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 60]
    # Validation is ~150 predicted tokens (the corpus's topped-up valid split), so its loss is noisy: 60 steps
    # took it from ln(1024) = 6.94 to 6.37 here, 40 steps to 6.50; a run that does not learn stays near 6.94.
    assert evals[1]["loss"] < evals[0]["loss"] - 0.3, evals
    train = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [10, 20, 30, 40, 50, 60]
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in train)
    assert {"lr", "loss_scale", "skipped_steps", "mfu", "memory_gb", "tokens_seen"} <= set(train[0])
    assert evals[1]["perplexity"] == pytest.approx(math.exp(evals[1]["loss"]))
    assert 0.0 <= evals[0]["accuracy"] < evals[1]["accuracy"] <= 1.0

    from roberta_fast.model import RobertaForMaskedLM

    hf = transformers.AutoModelForMaskedLM.from_pretrained(out / "final").eval()
    ours = RobertaForMaskedLM.from_pretrained(out / "final", backend="reference").eval()
    tok = transformers.AutoTokenizer.from_pretrained(out / "final")
    ids = tok(["The module defines a class.", "Return the value of <mask>."], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = hf(**ids).logits
        got = ours(ids["input_ids"], attention_mask=ids["attention_mask"]).logits
    real = ids["attention_mask"].bool()  # ours runs unpadded on the CPU: zeros at padded positions
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)
    fill = transformers.pipeline("fill-mask", model=str(out / "final"), tokenizer=str(out / "final"))
    assert len(fill("Return the <mask> of the object.")) == 5


def _params(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def _record_grads(trainer) -> list:
    """Make `trainer` append each step's gradients (all-reduced, before the optimizer) to the list returned."""
    grads, step = [], trainer.optimizer.step

    def recording_step(lr, scale):
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return step(lr, scale)

    trainer.optimizer.step = recording_step
    return grads


def _assert_same_training(grads, params, expected_grads, expected_params, lr):
    """The first step's gradients agree to float rounding; the weights to 1% of one Adam step.

    Adam's update m / (sqrt(v) + eps) divides by the gradient's own size, so where an
    entry is near eps a rounding difference in its sum (another reduction order, another
    CPU's matmul kernels) moves the update by a visible fraction of lr, and the next
    step's gradients start from those weights; a wrong gradient moves the update by
    about lr.
    """
    assert len(grads) == len(expected_grads)
    assert grads[0].keys() == expected_grads[0].keys()
    for name, expected in expected_grads[0].items():
        torch.testing.assert_close(grads[0][name], expected, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"first step's grad of {n}: {m}")
    for name, x in expected_params.items():
        torch.testing.assert_close(params[name], x, rtol=0.0, atol=0.01 * lr,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_grad_accumulation_equals_one_big_batch(dataset, tmp_path):
    """2 micro-batches of 4 give the update of one batch of 8 (same rows, same masks)."""
    big = Trainer(small_config(dataset, tmp_path / "a", batch_size=8, dropout=0.0, clip_grad_norm=0.5))
    accum = Trainer(small_config(dataset, tmp_path / "b", batch_size=4, grad_accum=2, dropout=0.0,
                                 clip_grad_norm=0.5))
    big_grads, accum_grads = _record_grads(big), _record_grads(accum)
    assert accum.grad_accum == 2 and accum.global_batch == big.global_batch == 8
    for _ in range(3):
        batch = big.next_micro_batches()[0]
        halves = [{k: v[i:i + 4] for k, v in batch.items()} for i in (0, 4)]
        # the loaders agree too: the accumulating trainer reads the same rows
        for h, mine in zip(halves, accum.next_micro_batches()):
            assert torch.equal(h["input_ids"], mine["input_ids"])
        a, b = big.train_step([batch]), accum.train_step(halves)
        assert a["count"] == b["count"]
        torch.testing.assert_close(a["loss_sum"], b["loss_sum"], rtol=1e-5, atol=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    _assert_same_training(accum_grads, _params(accum), big_grads, _params(big), big.cfg.lr)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, dataset, out, steps, result):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    trainer = Trainer(small_config(dataset, out, batch_size=2, grad_accum=2, dropout=0.0, mode="doc", seq_len=64),
                      log=lambda *a: None)
    grads = _record_grads(trainer)
    try:
        assert trainer.ddp is not None and trainer.global_batch == 8
        rows, norms, tokens = [], [], []
        for _ in range(steps):  # each rank's own rows, from its own loader (no_sync on micro-step 0)
            micro = trainer.next_micro_batches()
            rows.append([batch["input_ids"] for batch in micro])
            stats = trainer.train_step(micro)
            trainer._accumulate(stats)  # as the run loop does, into the log interval a checkpoint saves
            norms.append(stats["grad_norm"])
            tokens.append(stats["tokens"])
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, rows)
        window = trainer.state_dict()["window"]  # collective
        if rank == 0:
            torch.save({"params": _params(trainer), "norms": norms, "grads": grads, "rows": everyone, "tokens": tokens,
                        "tokens_seen": trainer.tokens_seen, "window": window}, result)
        trainer.dist.barrier()  # leave the group together: a rank gone early aborts gloo's other rank
    finally:
        trainer.close()


def test_ddp_two_processes_equal_one_with_the_whole_batch(dataset, tmp_path):
    """2 gloo processes x 2 accumulated micro-batches of 2 == 1 process with batches of 8: the same
    rows in each step, masked alike (a mask follows the row's position in its step, which once
    differed between the ranks' interleaved rows and one process's), so the same update. DOC-SENTENCES
    rows end in padding, so the ranks' non-pad tokens differ: tokens (tokens_seen, tokens/s, MFU) are
    their sum, not rank 0's times 2 as they once were. A checkpoint's log interval holds every rank's
    loss sum (it held rank 0's: the first line after a resume was wrong)."""
    single = Trainer(small_config(dataset, tmp_path / "single", batch_size=8, dropout=0.0, mode="doc", seq_len=64))
    grads = _record_grads(single)
    batches = [single.next_micro_batches()[0] for _ in range(2)]
    stats = [single.train_step([batch]) for batch in batches]
    for step_stats in stats:
        single._accumulate(step_stats)
    norms, tokens = [s["grad_norm"] for s in stats], [s["tokens"] for s in stats]
    assert tokens == [int(batch["attention_mask"].sum()) for batch in batches] and sum(tokens) < 2 * 8 * 64
    result = str(tmp_path / "ddp.pt")
    mp.spawn(_ddp_worker, args=(2, _free_port(), dataset, str(tmp_path / "ddp"), 2, result), nprocs=2)
    ddp = torch.load(result)
    for step, batch in enumerate(batches):  # step rows: micro-step m of rank r at m * 4 + r * 2
        ranks = [ddp["rows"][rank][step] for rank in range(2)]
        assert torch.equal(torch.cat([ranks[r][m] for m in range(2) for r in range(2)]), batch["input_ids"])
    assert ddp["norms"] == pytest.approx(norms, rel=1e-5)
    assert ddp["tokens"] == tokens and ddp["tokens_seen"] == single.tokens_seen == sum(tokens)
    for key in ("loss", "count"):
        assert float(ddp["window"][key]) == pytest.approx(float(single.state_dict()["window"][key]), rel=1e-5), key
    _assert_same_training(ddp["grads"], ddp["params"], grads, _params(single), single.cfg.lr)


def _locked_out_worker(rank, world, port, dataset, out, result):
    from pathlib import Path

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        Trainer(small_config(dataset, out), log=lambda *a: None).close()
        outcome = "started"
    except Exception as err:  # noqa: BLE001 -- recorded for the test
        outcome = f"{type(err).__name__}: {str(err)[:40]}"
    Path(f"{result}.{rank}").write_text(outcome)


def test_ddp_ranks_stop_when_rank_0_cannot_take_the_out_lock(dataset, tmp_path):
    """Only rank 0 takes --out's lock: held by another run, every rank stops there (rank 0 with the lock's
    error, the others PeerFailed), where the others went on to build and train into a collective rank 0
    never reached (gloo's traceback after the real error; a hang under NCCL)."""
    from roberta_fast.trainer import lock_out

    lock = lock_out(tmp_path / "run", lambda *a: None)  # another run's
    try:
        result = str(tmp_path / "outcome")
        mp.spawn(_locked_out_worker, args=(2, _free_port(), dataset, str(tmp_path / "run"), result), nprocs=2)
    finally:
        lock.release()
    assert open(result + ".0").read().startswith("ValueError: another run (pid")
    assert open(result + ".1").read() == "PeerFailed: rank 0 stopped (its error says why)"


def test_nccl_barrier_names_this_ranks_gpu(monkeypatch):
    """A barrier before any other NCCL collective (the trainer's first one, in
    _default_dataset) otherwise runs on GPU rank % device_count in torch 2.4-2.x,
    not this rank's LOCAL_RANK GPU: a wrong GPU, or a hang, when they differ."""
    import torch.distributed as dist

    from roberta_fast.trainer import Dist

    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "1")
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(kw))
    d = Dist()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    d.init(torch.device("cuda", 1))
    d.barrier()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    d.init(torch.device("cpu"))
    d.barrier()
    assert calls == [{"device_ids": [1]}, {}]


def test_fp16_overflow_skips_the_step_and_halves_the_scale(dataset, tmp_path):
    trainer = Trainer(small_config(dataset, tmp_path / "fp16", precision="fp16", init_loss_scale=2.0 ** 120,
                                   dropout=0.0))
    before = _params(trainer)
    stats = trainer.train_step(trainer.next_micro_batches())  # loss x 2^120 overflows fp16 gradients
    assert stats["skipped"]
    assert trainer.scaler.scale == 2.0 ** 119 and trainer.scaler.skipped == 1
    assert trainer.schedule.num_updates == 0 and trainer.step == 1
    for state in trainer.optimizer.state_dict()["state"].values():  # Adam moments untouched
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    for name, x in _params(trainer).items():
        assert torch.equal(x, before[name]), name
    trainer.scaler.scale = 2.0 ** 8
    stats = trainer.train_step(trainer.next_micro_batches())
    assert not stats["skipped"] and trainer.schedule.num_updates == 1
    assert all(torch.isfinite(v).all() for v in _params(trainer).values())
    assert any(not torch.equal(x, before[k]) for k, x in _params(trainer).items())


def test_persistent_nonfinite_stops_with_a_checkpoint(dataset, tmp_path):
    cfg = small_config(dataset, tmp_path / "nan", precision="fp16", init_loss_scale=2.0 ** 120, max_bad_steps=2)
    trainer = Trainer(cfg, log=lambda *a: None)
    with pytest.raises(RuntimeError, match="not finite for 2 consecutive steps, up to step 2"):
        trainer.run()
    trainer.close()
    assert (tmp_path / "nan" / "checkpoints" / "step_00000002.pt").is_file()


def test_a_start_that_loses_the_race_for_a_new_out_leaves_the_winners_out_alone(dataset, tmp_path, monkeypatch):
    """Two runs started together on a new --out: the one refused by the other's lock must not remove the
    --out and run.lock the other made (a third run could then write there too)."""
    from roberta_fast import trainer as trainer_module

    winner, real_lock_out = [], trainer_module.lock_out

    def other_run_wins_first(out, log):  # between this run's exists() check and its lock
        out.mkdir()
        winner.append(trainer_module.RunLock(out).acquire())
        return real_lock_out(out, log)

    monkeypatch.setattr(trainer_module, "lock_out", other_run_wins_first)
    with pytest.raises(ValueError, match="another run .* is writing to"):
        Trainer(small_config(dataset, tmp_path / "new"))
    assert (tmp_path / "new" / "run.lock").is_file()
    with pytest.raises(ValueError, match="another run .* is writing to"):  # still held: a third run is refused too
        trainer_module.RunLock(tmp_path / "new").acquire()
    winner[0].release()


def test_bad_inputs_fail_before_training(dataset, tmp_path, capsys, monkeypatch):
    with pytest.raises(ValueError, match="not a preprocessed dataset"):
        Trainer(small_config(str(tmp_path / "nowhere"), tmp_path / "o1"))
    assert not (tmp_path / "o1").exists()  # a failed start leaves no --out it made (its run.lock alone)
    (tmp_path / "o1").mkdir()
    with pytest.raises(ValueError, match="not a preprocessed dataset"):
        Trainer(small_config(str(tmp_path / "nowhere"), tmp_path / "o1"))
    assert (tmp_path / "o1").is_dir()  # the user's own directory is kept
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="not writable"):
        Trainer(small_config(dataset, blocker / "out"))
    with pytest.raises(ValueError, match="global_batch_size 10 is not a multiple"):
        Trainer(small_config(dataset, tmp_path / "o2", global_batch_size=10))
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        Trainer(small_config(dataset, tmp_path / "o2", init_from=str(tmp_path)))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="--init-from: 'acme/missing' is neither a local directory"):
        Trainer(small_config(dataset, tmp_path / "o2", init_from="acme/missing"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is available"):
            Trainer(small_config(dataset, tmp_path / "o2", device="cuda"))
    assert main(["--data", dataset, "--out", str(tmp_path / "o3"), "--lr", "-1", "--warmup-steps", "700"]) == 2
    err = capsys.readouterr().err
    assert "lr must be > 0" in err and "warmup_steps (700) must not exceed max_steps (300)" in err
    assert not (tmp_path / "o3").exists()


def test_resume_refusals(dataset, tmp_path):
    Trainer(small_config(dataset, tmp_path / "o"), log=lambda *a: None).save_checkpoint()
    with pytest.raises(ValueError, match="already holds checkpoints and --resume never"):
        Trainer(small_config(dataset, tmp_path / "o", resume="never")).maybe_resume()
    with pytest.raises(ValueError, match=r"differs from this config in hidden_size \(32 vs 64\)"):
        Trainer(small_config(dataset, tmp_path / "o", hidden_size=64)).maybe_resume()


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(schedule={}), "restoring it met KeyError 'num_updates'"),
    (lambda s: s.update(optimizer={"x": 1}), "restoring it met KeyError 'param_groups'"),
    (lambda s: s.update(loader={}), "restoring it met KeyError"),
    (lambda s: s.update(scaler=[]), "its 'scaler' is list"),
    (lambda s: s["model"].update({"roberta.embeddings.word_embeddings.weight": torch.zeros(1)}),
     "its weights do not fit this run's model (size mismatch for roberta.embeddings.word_embeddings.weight"),
])
def test_resume_from_an_edited_checkpoint_says_which_field_is_wrong(dataset, tmp_path, capsys, edit, message):
    """A checkpoint whose fields were edited (or written by another program) loads under weights_only;
    --resume PATH refuses it in one line naming the field (exit 2), not a KeyError traceback."""
    trainer = Trainer(small_config(dataset, tmp_path / "o"), log=lambda *a: None)
    state = trainer.state_dict()
    trainer.close()
    edit(state)
    (tmp_path / "edited").mkdir()
    atomic_torch_save(state, tmp_path / "edited" / "step_00000000.pt")
    resume = ["--out", str(tmp_path / "fresh"), "--resume", str(tmp_path / "edited" / "step_00000000.pt")]
    assert main(small_argv(dataset) + resume) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint ") and message in err, err


def test_resume_never_runs_code_from_a_checkpoint(dataset, tmp_path, capsys):
    """A crafted checkpoint given to --resume PATH, or lying in --out (--resume auto), is
    refused with the error naming --trust-checkpoint; its payload never runs."""
    marker = tmp_path / "pwned"
    evil = tmp_path / "from_a_colleague" / "step_00000005.pt"
    write_malicious_checkpoint(evil, marker)
    write_malicious_checkpoint(tmp_path / "out" / "checkpoints" / "step_00000005.pt", marker)
    small = small_argv(dataset)
    assert main(small + ["--out", str(tmp_path / "fresh"), "--resume", str(evil)]) == 2
    assert main(small + ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("refusing to load checkpoint") == 2 and "posix.system" in err and "--trust-checkpoint" in err
    assert not marker.exists(), "resuming ran the checkpoint's code"


def test_an_old_format_checkpoint_resumes_exactly_with_trust_checkpoint(dataset, tmp_path):
    """A checkpoint written before weights-only checkpoints (NumPy's RNG state as its legacy
    tuple) is refused by default and, with --trust-checkpoint, resumes as a straight run."""
    whole, _ = run(small_config(dataset, tmp_path / "whole"))
    run(small_config(dataset, tmp_path / "split", stop_at=3))
    path = tmp_path / "split" / "checkpoints" / "step_00000003.pt"
    state = torch.load(path, weights_only=True)
    for rng in state["rng"]:  # back to the old layout
        numpy_state = rng["numpy"]
        rng["numpy"] = ("MT19937", numpy_state["state"]["key"].numpy().astype("uint32"),
                        numpy_state["state"]["pos"], numpy_state["has_gauss"], numpy_state["gauss"])
    torch.save(state, path)
    (path.parent / (path.name + ".sha256")).unlink()  # files of that era had no checksum
    with pytest.raises(ValueError, match="--trust-checkpoint"):
        run(small_config(dataset, tmp_path / "split"))
    resumed, summary = run(small_config(dataset, tmp_path / "split", trust_checkpoint=True))
    assert summary["status"] == "finished"
    assert train_losses(tmp_path / "split") == train_losses(tmp_path / "whole")
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("masking, mode, precision", [("whole_word", "doc", "fp32"), ("span", "full", "bf16")])
def test_other_maskings_modes_and_bf16_train(dataset, tmp_path, masking, mode, precision):
    trainer = Trainer(small_config(dataset, tmp_path / "o", masking=masking, mode=mode, precision=precision))
    stats = trainer.train_step(trainer.next_micro_batches())
    assert not stats["skipped"] and stats["count"] > 0 and torch.isfinite(stats["loss_sum"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_run_falls_and_resumes(dataset, tmp_path):
    gpu = dict(device="cuda", precision="bf16", max_steps=30, warmup_steps=3, eval_every=30, batch_size=16,
               seq_len=64, hidden_size=64, lr=1e-2)
    whole, summary = run(small_config(dataset, tmp_path / "whole", **gpu))
    assert summary["last_eval"]["loss"] < summary["first_eval"]["loss"] - 0.5
    run(small_config(dataset, tmp_path / "split", stop_at=15, **gpu))
    run(small_config(dataset, tmp_path / "split", **gpu))
    a, b = train_losses(tmp_path / "whole"), train_losses(tmp_path / "split")
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 31))
    assert [x for _, x in b] == pytest.approx([x for _, x in a], rel=1e-2)


def test_packed_doc_sentences_train_and_evaluate(dataset, tmp_path):
    """--mode doc --pack: rows hold several documents; the step and the evaluation run on them."""
    trainer = Trainer(small_config(dataset, tmp_path / "o", mode="doc", pack=True), log=lambda *a: None)
    batch = trainer.next_micro_batches()[0]
    assert {"cu_seqlens", "position_ids", "max_seqlen"} <= set(batch)  # tests/test_packed.py checks the model
    stats = trainer.train_step([batch])
    assert not stats["skipped"] and stats["count"] > 0 and torch.isfinite(stats["loss_sum"])
    assert math.isfinite(trainer.evaluate()["loss"])
    with pytest.raises(ValueError, match="use it with --mode doc"):
        small_config(dataset, tmp_path / "p", pack=True).validate()


@pytest.mark.parametrize("pack", [False, True], ids=["doc", "doc-packed"])
def test_mfu_counts_attention_within_each_document(dataset, tmp_path, pack):
    """DOC-SENTENCES rows attend within their document (packed rows: within each of theirs), not to the
    padding: a step's attended pairs, MFU's attention term, are each document's length squared (it counted
    seq_len x tokens, every row as a full one)."""
    trainer = Trainer(small_config(dataset, tmp_path / "o", mode="doc", pack=pack, seq_len=512,
                                   batch_size=16), log=lambda *a: None)
    try:
        batch = trainer.next_micro_batches()[0]
        stats = trainer.train_step([batch])
        first_position = trainer.model_config.pad_token_id + 1
    finally:
        trainer.close()
    lengths = []
    for b, mask in enumerate(batch["attention_mask"].bool()):
        if pack:  # documents start where the positions restart
            starts = (batch["position_ids"][b][mask] == first_position).nonzero().flatten().tolist()
            lengths += [end - start for start, end in zip(starts, starts[1:] + [int(mask.sum())])]
        else:
            lengths.append(int(mask.sum()))
    assert stats["pairs"] == sum(n * n for n in lengths) < trainer.cfg.seq_len * stats["tokens"]


def test_attended_pairs_of_packed_rows_are_their_documents_squared():
    """Two packed rows of 8: documents of 3 + 4 (and a padding tail of 1), and of 8."""
    from roberta_fast.data import collate
    from roberta_fast.trainer import attended_pairs

    def sample(lengths, seq_len=8):
        n = sum(lengths)
        return {"input_ids": torch.zeros(seq_len, dtype=torch.int64).numpy(),
                "attention_mask": (torch.arange(seq_len) < n).long().numpy(),
                "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).numpy()}

    batch = collate([sample([3, 4]), sample([8])], 8)
    assert attended_pairs(batch) == 3 * 3 + 4 * 4 + 8 * 8
    assert attended_pairs({"attention_mask": batch["attention_mask"]}) == 7 * 7 + 8 * 8  # unpacked: whole rows


@pytest.mark.parametrize("pack", [False, True], ids=["full", "doc-packed"])
def test_fused_backend_trains_like_the_reference(dataset, tmp_path, pack):
    """The whole step on backend="fused" (Triton kernels; the interpreter on a CPU) against
    "reference", dropout off: the same losses over a few optimizer steps."""
    pytest.importorskip("triton")
    losses = {}
    for backend in ("reference", "fused"):
        cfg = small_config(dataset, tmp_path / backend, backend=backend, dropout=0.0, max_steps=3,
                           hidden_size=64, num_attention_heads=2, intermediate_size=128,  # head dim 32: fused
                           mode="doc" if pack else "full", pack=pack)
        trainer = Trainer(cfg, log=lambda *a: None)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # e.g. a fallback to the reference attention
                steps = [trainer.train_step(trainer.next_micro_batches()) for _ in range(3)]
        finally:
            trainer.close()
        losses[backend] = torch.tensor([float(s["loss_sum"]) / float(s["count"]) for s in steps])
    torch.testing.assert_close(losses["fused"], losses["reference"], rtol=1e-4, atol=1e-4)


def test_spanbert_objective_lowers_both_losses_resumes_exactly_and_exports(dataset, tmp_path, capsys):
    """--objective mlm+sbo: MLM and SBO losses both logged (step 0's line too) and falling; a
    run stopped at step 6 and resumed equals a straight one (SBO head and its Adam state
    included); the export loads in transformers with the SBO head beside it."""
    transformers = pytest.importorskip("transformers")
    spanbert = dict(masking="span", objective="mlm+sbo", max_steps=12, eval_every=12, dropout=0.0)
    whole, _ = run(small_config(dataset, tmp_path / "whole", **spanbert))
    lines = [line for line in capsys.readouterr().err.splitlines() if ": validation loss" in line]
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 12"]
    assert all(", SBO loss " in line for line in lines), lines
    run(small_config(dataset, tmp_path / "split", stop_at=6, **spanbert))
    resumed, summary = run(small_config(dataset, tmp_path / "split", **spanbert))
    assert summary["status"] == "finished"
    records = lambda out: [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]  # noqa: E731
    assert records(tmp_path / "split") and [(r["loss"], r["sbo_loss"]) for r in records(tmp_path / "split")] == \
        [(r["loss"], r["sbo_loss"]) for r in records(tmp_path / "whole")]
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert any(k.startswith("sbo.") for k in whole.model.state_dict())
    first, last = records(tmp_path / "whole")[:3], records(tmp_path / "whole")[-3:]
    for key in ("loss", "sbo_loss"):
        assert sum(r[key] for r in last) < sum(r[key] for r in first), key
    evals = [r for r in read_metrics(tmp_path / "whole" / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals[-1]["sbo_loss"] < evals[0]["sbo_loss"] and evals[-1]["sbo_predicted_tokens"] > 0
    final = tmp_path / "whole" / "final"
    assert (final / "sbo.safetensors").is_file()
    hf, info = transformers.AutoModelForMaskedLM.from_pretrained(final, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    from roberta_fast.export import main as export_main  # a checkpoint exports the same two files
    from roberta_fast.sbo import RobertaForSpanBERT

    assert export_main([str(tmp_path / "whole" / "checkpoints" / "step_00000012.pt"), "--out",
                        str(tmp_path / "exported")]) == 0
    reloaded = RobertaForSpanBERT.from_pretrained(tmp_path / "exported", backend="reference")
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, whole.model.state_dict()[name].cpu()), name


def test_sbo_needs_span_masking(dataset, tmp_path):
    with pytest.raises(ValueError, match="objective mlm\\+sbo needs --masking span"):
        Trainer(small_config(dataset, tmp_path / "o", objective="mlm+sbo"))


def test_activation_checkpointing_trains_as_without(dataset, tmp_path):
    """--activation-checkpointing recomputes each layer in the backward pass: the same run, dropout
    included (the recompute replays the RNG), so the same losses and weights."""
    argv = small_argv(dataset) + ["--max-steps", "3"]
    cfg = load_config(argv + ["--out", str(tmp_path / "ckpt"), "--activation-checkpointing"])
    assert cfg.activation_checkpointing and not load_config(argv + ["--out", "x"]).activation_checkpointing
    checkpointed, _ = run(cfg)
    plain, _ = run(load_config(argv + ["--out", str(tmp_path / "plain")]))
    assert checkpointed.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    assert train_losses(tmp_path / "ckpt") == train_losses(tmp_path / "plain")
    for (name, a), b in zip(checkpointed.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


# ------------------------------------------------------------------ the tokenizer the ids belong to
def _model_dir(dataset, out, tokenizer=None):
    """A 1-layer hidden-32 model of the dataset's vocabulary, exported with `tokenizer` (default: the
    dataset's own) as --init-from reads it."""
    import roberta_fast as rf
    from roberta_fast.data import load_manifest
    from roberta_fast.trainer import export_pretrained

    config = rf.RobertaConfig.preset("tiny", vocab_size=load_manifest(dataset)["vocab_size"], hidden_size=32,
                                     num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    return export_pretrained(rf.RobertaForMaskedLM(config), tokenizer or os.path.join(dataset, "tokenizer"), out)


def _same_size_other_tokenizer(dataset, out):
    """The dataset's tokenizer with two ids swapped: as many ids, other meanings."""
    from roberta_fast.tokenizer import RobertaTokenizer

    spec = json.loads(open(os.path.join(dataset, "tokenizer", "tokenizer.json"), encoding="utf-8").read())
    vocab = spec["model"]["vocab"]
    a, b = (token for token, i in vocab.items() if i in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    out.mkdir()
    (out / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return RobertaTokenizer.from_pretrained(out)


def test_init_from_refuses_a_model_of_another_tokenizer(dataset, tmp_path):
    """A same-sized vocabulary of other tokens is refused (its ids mean other tokens to the model),
    and so is a model directory with no tokenizer to check; the dataset's own is accepted."""
    other = _same_size_other_tokenizer(dataset, tmp_path / "other_tok")
    _model_dir(dataset, tmp_path / "other", tokenizer=other)
    with pytest.raises(ValueError, match="the dataset was tokenized with tokenizer .* but --init-from .* was trained "
                                         "with tokenizer .*preprocess the text again with --tokenizer"):
        Trainer(small_config(dataset, tmp_path / "o1", init_from=str(tmp_path / "other")))
    bare = _model_dir(dataset, tmp_path / "bare")
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        (bare / name).unlink()
    with pytest.raises(ValueError, match=r"has no tokenizer \(tokenizer.json, or vocab.json \+ merges.txt\).*copy"):
        Trainer(small_config(dataset, tmp_path / "o2", init_from=str(bare)))
    trainer = Trainer(small_config(dataset, tmp_path / "o3", init_from=str(_model_dir(dataset, tmp_path / "own"))))
    trainer.close()


def test_init_from_applies_dropout_and_refuses_other_sizes(dataset, tmp_path):
    """--dropout applies to the --init-from model (and the printed config says so); a size flag
    that contradicts the model's is refused rather than silently ignored."""
    init = str(_model_dir(dataset, tmp_path / "init"))
    trainer = Trainer(small_config(dataset, tmp_path / "o1", init_from=init, dropout=0.0))
    try:
        config = trainer.model.config
        assert config.hidden_dropout_prob == config.attention_probs_dropout_prob == 0.0
        assert "dropout 0.0/0.0" in trainer.describe()
        ids = torch.randint(5, config.vocab_size - 1, (2, 16))
        trainer.model.train()
        with torch.no_grad():  # no dropout: training mode is deterministic
            assert torch.equal(trainer.model(ids).logits, trainer.model(ids).logits)
    finally:
        trainer.close()
    with pytest.raises(ValueError, match=r"contradict the --init-from model .*--hidden-size 64 \(the model has 32\), "
                                         r"--num-hidden-layers 3 \(the model has 1\); drop those flags"):
        Trainer(small_config(dataset, tmp_path / "o2", init_from=init, hidden_size=64, num_hidden_layers=3))


def test_a_dataset_without_its_tokenizer_fails_before_training(dataset, tmp_path, capsys):
    """The export needs the dataset's tokenizer: missing or replaced, the run stops at start (exit 2)."""
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(dataset, copy)
    shutil.rmtree(copy / "tokenizer")
    argv = small_argv(str(copy)) + ["--out", str(tmp_path / "run")]
    assert main(argv) == 2
    assert "tokenizer' is missing" in capsys.readouterr().err
    _same_size_other_tokenizer(dataset, copy / "tokenizer")
    assert main(argv) == 2
    assert "not the tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("before, after", [("mlm", "mlm+sbo"), ("mlm+sbo", "mlm")])
def test_resume_refuses_another_objective(dataset, tmp_path, capsys, before, after):
    span = ["--masking", "span"]
    trainer = Trainer(load_config(small_argv(dataset) + span + ["--objective", before, "--out", str(tmp_path)]))
    trainer.save_checkpoint()
    trainer.close()
    assert main(small_argv(dataset) + span + ["--objective", after, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"error: the checkpoint was trained with --objective {before}, this run asks for --objective {after}; " \
           f"resume with --objective {before}, or use a new --out" in err and err.count("\n") == 1


def test_resume_refuses_data_of_another_tokenizer(dataset, tmp_path):
    trainer = Trainer(small_config(dataset, tmp_path))
    try:
        state = trainer.state_dict()
        assert state["tokenizer_hash"] == trainer.manifest["tokenizer_hash"]
        state["tokenizer_hash"] = "0" * 64
        with pytest.raises(ValueError, match="trained on ids of tokenizer 000000000000, but the dataset"):
            trainer.load_state_dict(state)
    finally:
        trainer.close()


def test_rerunning_a_rollback_goes_on_after_its_checkpoint_was_pruned(dataset, tmp_path, capsys):
    """The checkpoint rolled back to is an ordinary one of --out: pruning may delete it. Rerunning the
    same command then goes on from the newest checkpoint of the line resumed from it."""
    argv = small_argv(dataset) + ["--save-every", "2", "--out", str(tmp_path / "run")]
    assert main(argv + ["--stop-at", "4"]) == 0
    older = tmp_path / "run" / "checkpoints" / "step_00000002.pt"
    rollback = argv + ["--resume", str(older), "--keep-checkpoints", "1"]
    assert main(rollback + ["--stop-at", "3"]) == 0
    assert not older.exists()  # pruned: --keep-checkpoints 1
    capsys.readouterr()
    assert main(rollback) == 0
    out = capsys.readouterr().out
    assert f"--resume {older} is gone (pruned by --keep-checkpoints)" in out and "at step 3" in out
    assert [s for s, _ in train_losses(tmp_path / "run")][-1] == 6


def test_under_torchrun_a_mistake_every_rank_makes_is_reported_once(monkeypatch, capsys):
    """A bad config fails every rank alike: rank 0 says it, the others stay quiet; an error of one
    rank's own (RuntimeError) names its rank."""
    from roberta_fast.train import report

    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, expected in (("0", "error: [rank 0] invalid training config"), ("1", "")):
        monkeypatch.setenv("RANK", rank)
        assert main(["--max-steps", "0"]) == 2
        assert capsys.readouterr().err.strip().startswith(expected) if expected else not capsys.readouterr().err
    report(RuntimeError("out of memory"), every_rank=True)
    assert capsys.readouterr().err == "error: [rank 1] out of memory\n"


@pytest.mark.parametrize("capability, arch_list, runs", [
    ((7, 0), ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"], False),  # V100, torch cu130
    ((7, 0), ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"], True),  # V100, torch cu126
    ((7, 5), ["sm_75", "sm_80", "sm_90"], True),
    ((8, 6), ["sm_80", "sm_90"], True),  # sm_80 binaries run on sm_86
    ((9, 0), ["sm_80", "sm_90a"], True),
    ((8, 9), ["sm_75", "compute_75"], True),  # PTX JIT-compiles for newer GPUs
    ((12, 0), ["sm_80", "sm_90"], False),
])
def test_a_gpu_this_torch_has_no_kernels_for_is_refused_before_training(capability, arch_list, runs):
    """torch >= 2.11's CUDA 12.8 / 13 wheels dropped sm_70: a V100 user gets a clear error naming the
    CUDA 12.6 build, not torch's "no kernel image is available" at the first kernel."""
    from roberta_fast.trainer import check_torch_runs_on

    if runs:
        check_torch_runs_on(capability, arch_list, "GPU")
        return
    with pytest.raises(ValueError, match="has no kernels in this torch build") as err:
        check_torch_runs_on(capability, arch_list, "Tesla V100-SXM2-16GB")
    assert ("whl/cu126" in str(err.value)) == (capability < (7, 5)) and "--device cpu" in str(err.value)


def test_resolve_device_checks_the_gpu_against_torch_s_kernels(monkeypatch):
    """resolve_device runs that check on the GPU it picks (CUDA faked: no GPU here)."""
    from roberta_fast import trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-PCIE-32GB")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_80", "sm_90"])
    with pytest.raises(ValueError, match=r"Tesla V100-PCIE-32GB \(sm_70\) has no kernels"):
        trainer.resolve_device("auto", 0)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_70", "sm_75"])
    assert trainer.resolve_device("auto", 0) == torch.device("cuda", 0)


def test_a_non_finite_last_validation_loss_is_reported_not_a_crash(dataset, tmp_path):
    """metrics.jsonl records a NaN eval loss as null; the end-of-run summary once formatted that
    None with :.4f (TypeError after the export). Now it says "not finite" and warns."""
    lines = []

    def ruin_weights(trainer):  # after the last step: the final evaluation sees NaN weights
        if trainer.step == SMALL["max_steps"]:
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.fill_(float("nan"))

    trainer = Trainer(small_config(dataset, tmp_path / "run"), log=lambda *a: lines.append(" ".join(map(str, a))))
    try:
        summary = trainer.run(on_step=ruin_weights)
    finally:
        trainer.close()
    assert summary["status"] == "finished"
    text = "\n".join(lines)
    assert "-> last not finite (step 6)" in text and "warning: the last validation loss is not finite" in text


@pytest.mark.parametrize("flag, value, message", [
    ("--init-from", "", "init_from is empty"), ("--data", "", "data is empty"), ("--out", " ", "out is empty"),
    ("--lr", "inf", "lr must be finite"), ("--eps", "inf", "eps must be finite"),
    ("--weight-decay", "inf", "weight_decay must be finite"), ("--init-loss-scale", "inf", "init_loss_scale must be finite"),
])
def test_empty_paths_and_infinite_optimizer_values_are_refused(flag, value, message):
    """An unset shell variable (--init-from "$CKPT") once meant random weights, --data "" the embedded
    corpus; --lr inf trained to NaN weights and --eps inf trained nothing, both accepted."""
    from roberta_fast.train_config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(["--preset", "tiny", flag, value])


def test_the_first_record_after_a_resume_rates_only_the_work_since(dataset, tmp_path, monkeypatch):
    """The log window's loss sums go on across a resume (the checkpoint keeps them), but tokens/s and
    MFU rate the work since the new clock: the predicted tokens before the stop are not divided by the
    time after it (which made the first MFU after every resume too high, up to x4)."""
    import roberta_fast.trainer as trainer_module

    rates = []
    real = trainer_module.estimate_mfu
    monkeypatch.setattr(trainer_module, "estimate_mfu", lambda cfg, tokens_per_s, predicted_per_s, *rest: (
        rates.append(predicted_per_s / tokens_per_s), real(cfg, tokens_per_s, predicted_per_s, *rest))[1])
    run(small_config(dataset, tmp_path / "run", log_every=5, stop_at=4))  # a stop inside the first window
    run(small_config(dataset, tmp_path / "run", log_every=5))
    assert len(rates) == 2 and max(rates) < 0.3, rates  # (steps 5 and 6) ~15% of tokens are predicted, not 15% x 5


def test_a_skipped_step_does_not_blank_its_windows_loss(dataset, tmp_path, monkeypatch):
    """A step with a non-finite loss (an fp16 forward overflow) is skipped; the window's loss averages
    the steps that updated, instead of becoming null for the whole window."""
    real = Trainer.loss_sums
    calls = []

    def overflowing(out):
        sums = real(out)
        calls.append(1)
        return sums * float("inf") if len(calls) == 3 else sums  # the third forward: step 2's (step 1: eval off)

    monkeypatch.setattr(Trainer, "loss_sums", staticmethod(overflowing))
    trainer, _ = run(small_config(dataset, tmp_path / "run", log_every=3, eval_every=100))
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert records[0]["skipped_steps"] >= 1 and [r["step"] for r in records] == [3, 6]
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in records), records


def test_a_diverged_evaluation_reports_an_infinite_perplexity(dataset, tmp_path):
    trainer = Trainer(small_config(dataset, tmp_path / "run"), log=lambda *a: None)
    try:
        with torch.no_grad():
            trainer.model.lm_head.bias.fill_(-1e4)
            trainer.model.lm_head.bias[0] = 1e4  # every prediction: token 0, by far
        result = trainer.evaluate()
        assert result["loss"] > 1000 and result["perplexity"] == math.inf
        assert "perplexity inf" in trainer._eval_line(0, result)
        assert trainer._eval_line(0, {**result, "loss": 20.0, "perplexity": math.exp(20.0)}).count("perplexity 4.852e+08")
    finally:
        trainer.close()


def test_a_full_disk_at_the_loss_plot_does_not_fail_a_finished_run(dataset, tmp_path, monkeypatch, capsys):
    import errno

    import roberta_fast.trainer as trainer_module

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer_module, "plot_losses", full)
    assert main(small_argv(dataset) + ["--out", str(tmp_path / "run"), "--plot"]) == 0
    captured = capsys.readouterr()
    assert "loss plot skipped: no space left on the disk of" in captured.out + captured.err
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
