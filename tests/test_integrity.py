"""Integrity under faults (issues 20 and 28): damaged, unverifiable and foreign checkpoints,
with or without their sidecars; damaged shards and lying manifests; two trainers (or
fine-tunings) on one --out; a full disk at a checkpoint or an export; a bad --init-from; and
a fault-injection run that kills training and breaks its newest checkpoint. The runs are
test_train.py's and test_finetune.py's small ones (CPU, seconds)."""
import errno
import os
import random
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
from test_finetune import config as finetune_config
from test_finetune import task  # noqa: F401
from test_train import SMALL, dataset, run, small_argv, small_config, train_losses  # noqa: F401

from roberta_fast import checkpoint
from roberta_fast.checkpoint import (CheckpointManager, DamagedCheckpoint, DiskSpaceError, load_checkpoint,
                                     verify_checkpoint)
from roberta_fast.metrics import read_metrics
from roberta_fast.train import main

Usage = namedtuple("Usage", "total used free")


def flip_middle(path, n=64):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory):  # noqa: F811
    """A straight 6-step run and one stopped after step 4, checkpointing every step (keep 2)."""
    base = tmp_path_factory.mktemp("runs")
    run(small_config(dataset, base / "whole", save_every=1, export=False))
    run(small_config(dataset, base / "split", save_every=1, stop_at=4, export=False))
    return base


def split_run(runs, tmp_path):
    """A fresh copy of the run stopped after step 4 (checkpoints of steps 3 and 4)."""
    shutil.copytree(runs / "split", tmp_path / "split")
    return tmp_path / "split", tmp_path / "split" / "checkpoints" / "step_00000004.pt"


def resume_argv(dataset, out):  # noqa: F811
    return small_argv(dataset) + ["--out", str(out), "--save-every", "1", "--log-every", "1", "--eval-every", "3",
                                  "--eval-batches", "2", "--no-export"]  # as runs()


def sidecar(path):
    return path.with_name(path.name + ".sha256")


def without_sidecar(damage):
    def damage_and_delete(path):
        damage(path)
        sidecar(path).unlink()
    return damage_and_delete


def truncate(path):
    path.write_bytes(path.read_bytes()[:1000])


DAMAGES = {  # how a disk, a copy or a person breaks the newest checkpoint, and what loading it then says
    "flipped": (flip_middle, "is damaged: its content does not match the checksum sealed inside it"),
    "flipped, no sidecar": (without_sidecar(flip_middle), "is damaged: its content does not match the checksum "
                                                          "sealed inside it"),
    "truncated": (truncate, "is damaged: its end is missing or overwritten (truncated?)"),
    "truncated, no sidecar": (without_sidecar(truncate), "is damaged: its end is missing or overwritten"),
    "0 bytes, no sidecar": (without_sidecar(lambda p: p.write_bytes(b"")), "is empty (0 bytes)"),
    "sidecar not UTF-8": (lambda p: sidecar(p).write_bytes(b"\xff\xfe\x00garbage"),
                          "is damaged (it holds no SHA-256 digest)"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_auto_resume_falls_back_past_a_damaged_checkpoint(dataset, runs, tmp_path, capsys, damage):  # noqa: F811
    """The newest checkpoint damaged, with or without its sidecar: `--resume PATH` and
    `roberta_fast.export` on it stop with one line naming it (exit 2); auto-resume names it,
    sets it aside, takes the previous one, and the continued losses equal an uninterrupted run's."""
    from roberta_fast.export import main as export_main

    out, latest = split_run(runs, tmp_path)
    corrupt, message = DAMAGES[damage]
    corrupt(latest)
    argv = resume_argv(dataset, out)
    capsys.readouterr()
    assert main(argv + ["--resume", str(latest)]) == 2
    assert export_main([str(latest), "--out", str(tmp_path / "exported")]) == 2
    err = capsys.readouterr().err
    assert err.count(message) == 2 and err.count("\n") == 2 and str(latest.parent) in err, err
    assert main(argv) == 0
    logged = capsys.readouterr().out
    assert "skipping the damaged checkpoint step_00000004.pt: " in logged and message in logged
    assert f"resumed from {latest.parent / 'step_00000003.pt'} at step 3" in logged
    assert (latest.parent / "step_00000004.pt.damaged").is_file()  # set aside
    assert train_losses(out) == train_losses(runs / "whole")


def unsealed(path):
    """The checkpoint rewritten as a plain torch.save (no checksum inside): another program's
    file, or an older roberta_fast's."""
    torch.save(torch.load(path, weights_only=True), path)


def test_a_checkpoint_that_cannot_be_verified_is_never_trained_on_silently(dataset, runs, tmp_path, capsys):  # noqa: F811
    """No checksum inside and no sidecar: --resume PATH refuses it with the ways out, auto-resume
    skips it with a line naming it, and --trust-checkpoint loads it with a note."""
    out, latest = split_run(runs, tmp_path)
    unsealed(latest)
    sidecar(latest).unlink()
    argv = resume_argv(dataset, out)
    capsys.readouterr()
    assert main(argv + ["--resume", str(latest)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint '{latest}' cannot be verified: it carries no checksum inside" in err
    assert f"sha256sum step_00000004.pt > step_00000004.pt.sha256) or pass --trust-checkpoint" in err
    assert main(argv) == 0
    logged = capsys.readouterr().out
    assert "skipping the unverified checkpoint step_00000004.pt: " in logged and "at step 3" in logged
    assert (latest.parent / "step_00000004.pt.unverified").is_file()
    assert train_losses(out) == train_losses(runs / "whole")

    out, latest = split_run(runs, tmp_path / "trusted")
    unsealed(latest)
    sidecar(latest).unlink()
    assert main(resume_argv(dataset, out) + ["--trust-checkpoint"]) == 0
    logged = capsys.readouterr()
    assert f"note: --trust-checkpoint: loading {latest} unverified" in logged.out + logged.err
    assert "at step 4" in logged.out and train_losses(out) == train_losses(runs / "whole")


def test_a_raw_pickle_is_not_a_checkpoint_and_stops_the_run(dataset, runs, tmp_path, capsys):  # noqa: F811
    """A checkpoint that is a raw pickle (torch's legacy format) was put there by someone, not
    damaged by a disk: auto-resume and --resume both stop naming it, and nothing is set aside."""
    out, latest = split_run(runs, tmp_path)
    torch.save(torch.load(latest, weights_only=True), latest, _use_new_zipfile_serialization=False)
    argv = resume_argv(dataset, out)
    capsys.readouterr()
    assert main(argv) == 2
    assert main(argv + ["--resume", str(latest)]) == 2
    err = capsys.readouterr().err
    assert err.count(f"error: '{latest}' is not a roberta_fast checkpoint: it is a raw pickle") == 2, err
    assert latest.is_file() and not list(latest.parent.glob("*.damaged"))


def test_checkpoints_are_sealed_and_verify_with_or_without_their_sidecar(tmp_path):
    """The SHA-256 of the archive travels inside it (the zip comment), the sidecar beside it
    still checks with `sha256sum -c`, and a lone .pt verifies by itself."""
    import zipfile

    ckpt = CheckpointManager(tmp_path)
    path = ckpt.save(1, {"step": 1, "w": torch.arange(1000.0)})
    comment = zipfile.ZipFile(path).comment.decode()
    assert comment.startswith("roberta_fast sha256 ") and len(comment.split()[-1]) == 64
    digest = (tmp_path / "step_00000001.pt.sha256").read_text()
    assert digest.endswith("  step_00000001.pt\n")  # sha256sum -c format
    assert subprocess.run(["sha256sum", "-c", "step_00000001.pt.sha256"], cwd=tmp_path).returncode == 0
    assert verify_checkpoint(path) == "sealed+sidecar"
    (tmp_path / "step_00000001.pt.sha256").unlink()
    assert verify_checkpoint(path) == "sealed"
    assert torch.equal(load_checkpoint(path)["w"], torch.arange(1000.0))
    flip_middle(path, n=1)
    with pytest.raises(DamagedCheckpoint, match="does not match the checksum sealed inside it"):
        load_checkpoint(path)


def test_damaged_shards_are_named_with_the_fix(dataset, tmp_path):  # noqa: F811
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    flip_middle(data / "train" / "00000.bin", n=1)
    with pytest.raises(ValueError, match=r"is damaged: train/00000.bin \(checksum mismatch\); rerun the "
                                         r"`python -m roberta_fast.preprocess` command that made it"):
        run(small_config(str(data), tmp_path / "o"))
    run(small_config(str(data), tmp_path / "o", data_checksums=False, max_steps=1, warmup_steps=0))  # the flag skips it
    index = data / "train" / "00000.idx.npy"
    index.write_bytes(index.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"00000.idx.npy' should hold \d+ bytes but holds 100: the dataset is "
                                         "damaged; rerun"):
        run(small_config(str(data), tmp_path / "o2", data_checksums=False))


def test_preprocess_rerun_repairs_a_damaged_shard(dataset, tmp_path):  # noqa: F811
    from roberta_fast.preprocess import preprocess

    (tmp_path / "in.txt").write_text("".join(f"document {i} has some words in it.\n\n" for i in range(200)))
    kw = dict(workers=1, progress=False, log=lambda m: None)
    manifest = preprocess([tmp_path / "in.txt"], os.path.join(dataset, "tokenizer"), tmp_path / "ds", **kw)
    shard = manifest["splits"]["train"]["shards"][0]
    assert {"bin_bytes", "bin_sha256", "idx_bytes", "idx_sha256"} <= set(shard)
    good = (tmp_path / "ds" / shard["bin"]).read_bytes()
    flip_middle(tmp_path / "ds" / shard["bin"], n=1)
    logged = []
    preprocess([tmp_path / "in.txt"], os.path.join(dataset, "tokenizer"), tmp_path / "ds", **{**kw, "log": logged.append})
    assert any("is damaged or missing: redoing chunk 0" in m for m in logged)
    assert (tmp_path / "ds" / shard["bin"]).read_bytes() == good


def test_a_second_trainer_on_the_same_out_is_refused(dataset, tmp_path):  # noqa: F811
    """The same command started twice: the second exits 2 at once naming the first's pid;
    the first goes on, and its metrics.jsonl holds every step."""
    out = tmp_path / "run"
    second = {}

    def start_another(trainer):
        if trainer.step == 2:
            second["proc"] = subprocess.run([sys.executable, "-m", "roberta_fast.train", *small_argv(dataset),
                                             "--out", str(out)], capture_output=True, text=True, timeout=300)

    _, summary = run(small_config(dataset, out), on_step=start_another)
    proc = second["proc"]
    assert proc.returncode == 2, proc.stderr
    assert f"another run (pid {os.getpid()} on " in proc.stderr and "pass another --out" in proc.stderr
    assert summary["status"] == "finished"
    assert [s for s, _ in train_losses(out)] == [1, 2, 3, 4, 5, 6]
    assert [r["kind"] for r in read_metrics(out / "metrics.jsonl", raw=True)].count("train") == 6
    _, summary = run(small_config(dataset, out, max_steps=7, allow_schedule_change=True))  # lock released
    assert summary["step"] == 7


def test_no_room_for_a_checkpoint_is_a_clear_error_and_keeps_the_last_one(dataset, tmp_path, monkeypatch,  # noqa: F811
                                                                           capsys):
    """Once step 2 is saved the disk is full: the save of step 4 fails with the sizes and the
    directory in words, exit 1, step 2 stays intact, and the run resumes from it once there is room."""
    real = shutil.disk_usage
    ckpts = tmp_path / "run" / "checkpoints"

    def full_after_step_2(path):
        total, used, free = real(path)
        return Usage(total, used, 0 if (ckpts / "step_00000002.pt").exists() else free)

    monkeypatch.setattr(shutil, "disk_usage", full_after_step_2)
    argv = small_argv(dataset) + ["--out", str(tmp_path / "run"), "--save-every", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "not enough disk space to save checkpoint step_00000004.pt: it needs about" in err
    assert f"in '{ckpts}' and that disk has 0 bytes free" in err
    assert "step_00000002.pt, is untouched" in err
    assert [p.name for p in sorted(ckpts.iterdir())] == ["step_00000002.pt", "step_00000002.pt.sha256"]
    assert verify_checkpoint(ckpts / "step_00000002.pt") == "sealed+sidecar"
    monkeypatch.setattr(shutil, "disk_usage", real)
    assert main(argv) == 0


class SmallDisk:
    """A directory on a disk of `capacity` bytes: writes through checkpoint.open fail with ENOSPC
    past it and shutil.disk_usage reports what is left (the largest file count seen is kept)."""

    def __init__(self, directory, capacity):
        self.directory, self.capacity, self.most_files = directory, capacity, 0

    def used(self):
        files = [p for p in self.directory.iterdir() if p.name.endswith(".pt")]
        self.most_files = max(self.most_files, len(files))
        return sum(p.stat().st_size for p in self.directory.iterdir())

    def usage(self, path):
        return Usage(self.capacity, self.used(), max(0, self.capacity - self.used()))

    def open(self, file, mode="r", *args, **kwargs):
        f = open(file, mode, *args, **kwargs)
        if mode != "wb":
            return f
        disk = self

        class Limited:
            def write(self, data):
                if disk.used() + memoryview(data).nbytes > disk.capacity:
                    raise OSError(errno.ENOSPC, "No space left on device")
                n = f.write(data)
                f.flush()
                return n

            def __getattr__(self, name):
                return getattr(f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

        return Limited()


def test_keep_k_needs_room_for_k_and_a_full_disk_keeps_the_last_good(tmp_path, monkeypatch):
    """Checkpoints of 8 MB on a 20 MB disk with --keep-checkpoints 2: the third save deletes the
    oldest first (it would be pruned anyway), so the run never needs room for three. A write that
    fills the disk anyway is a DiskSpaceError, and the previous checkpoint is intact."""
    disk = SmallDisk(tmp_path, 20_000_000)
    monkeypatch.setattr(shutil, "disk_usage", disk.usage)
    monkeypatch.setattr(checkpoint, "open", disk.open, raising=False)
    ckpt = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        ckpt.save(step, {"step": step, "w": torch.full((2_000_000,), float(step))})
    assert [s for s, _ in ckpt.checkpoints()] == [3, 4] and disk.most_files == 2
    disk.capacity = 12_000_000  # someone else filled the disk; disk_usage still says there is room:
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1 << 40, 0, 1 << 40))
    with pytest.raises(DiskSpaceError, match="the disk ran out of space while saving checkpoint step_00000005.pt"):
        ckpt.save(5, {"step": 5, "w": torch.zeros(2_000_000)})
    assert [s for s, _ in ckpt.checkpoints()] == [3, 4] and not list(tmp_path.glob(".*.tmp"))
    assert torch.equal(load_checkpoint(tmp_path)["w"], torch.full((2_000_000,), 4.0))


def test_a_bad_init_from_is_one_line_and_exit_2(dataset, tmp_path, capsys):  # noqa: F811
    from roberta_fast import RobertaConfig, RobertaForMaskedLM, RobertaTokenizer

    model_dir = tmp_path / "model"
    cfg = RobertaConfig.preset("tiny", vocab_size=1024, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)
    RobertaForMaskedLM(cfg).save_pretrained(model_dir)
    RobertaTokenizer.from_pretrained(os.path.join(dataset, "tokenizer")).save(model_dir)  # the dataset's: accepted
    for weights in model_dir.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    argv = small_argv(dataset) + ["--out", str(tmp_path / "o"), "--init-from", str(model_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --init-from '{model_dir}': cannot load the model") and err.count("\n") == 1
    (model_dir / "config.json").write_text("{not json")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and err.count("\n") == 1


# ---------------------------------------------------------------------- locks
def test_run_lock_as_a_directory_is_one_line(dataset, tmp_path, capsys):  # noqa: F811
    (tmp_path / "run" / "run.lock").mkdir(parents=True)
    assert main(small_argv(dataset) + ["--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: '{tmp_path / 'run' / 'run.lock'}' is a directory, where roberta_fast keeps its "
                   "one-writer lock file: remove it (rmdir) or pass another --out\n")


def finetune_argv(task, out, epochs=1):
    return ["--model", str(task / "model"), "--train", str(task / "train.csv"), "--valid", str(task / "valid.jsonl"),
            "--out", str(out), "--text-field", "sentence", "--max-len", "32", "--epochs", str(epochs),
            "--lr", "2e-3", "--device", "cpu", "--precision", "fp32", "--log-every", "1"]


def test_two_finetunes_on_one_out_are_refused(task, tmp_path, capsys):  # noqa: F811
    """A fine-tuning run holds --out as the trainer does: a second one started on it exits 2
    at once naming the first; the first's metrics.jsonl holds each step once, and a lock left
    by a finished (or killed) run does not block the next."""
    from roberta_fast.finetune import Finetuner
    from roberta_fast.finetune import main as finetune_main

    out = tmp_path / "cls"
    first = Finetuner(finetune_config(task, out, epochs=1), log=lambda *_: None)
    assert finetune_main(finetune_argv(task, out)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"another run (pid {os.getpid()} on " in err.splitlines()[-1]
    assert "pass another --out" in err
    first.run()
    first.close()
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl", raw=True) if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and len(steps) == first.step
    assert (out / "run.lock").is_file()  # left behind, as after a kill -9: not a stale lock
    assert finetune_main(finetune_argv(task, out, epochs=2) + ["--allow-schedule-change"]) == 0


# ---------------------------------------------------------------------- disk space
def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_the_final_export_keeps_the_checkpoint(dataset, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The disk fills while the final export writes model.safetensors (safetensors raises its own
    error, "os error 28"): one line naming final/ and the room needed, exit 1, nothing
    half-written; the last checkpoint stays, and the rerun exports without training again."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "run"
    argv = small_argv(dataset) + ["--out", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err.splitlines()[-1]  # (the lines before it: the run's progress)
    assert err.startswith(f"error: not enough disk space to export the model to '{out / 'final'}': it needs about ")
    assert err.endswith("The checkpoint of step 6 is kept: the rerun exports it without training again")
    assert [p.name for p in out.iterdir() if "final" in p.name] == []  # no final/, no temporary directory
    assert (out / "checkpoints" / "step_00000006.pt").is_file()
    trained = [r for r in read_metrics(out / "metrics.jsonl", raw=True) if r["kind"] == "train"]
    monkeypatch.undo()
    assert main(argv) == 0 and (out / "final" / "model.safetensors").is_file()
    assert [r for r in read_metrics(out / "metrics.jsonl", raw=True) if r["kind"] == "train"] == trained


def test_a_full_disk_in_finetuning_is_one_line_and_the_rerun_exports(task, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Fine-tuning: no room for a checkpoint is one line (exit 1), not a traceback; a disk that
    fills during the best epoch's export is one line naming model/, and the rerun exports that
    epoch from its checkpoint without training again."""
    import safetensors.torch

    from roberta_fast.finetune import main as finetune_main

    out = tmp_path / "cls"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(*real(p)[:2], 0))
    assert finetune_main(finetune_argv(task, out)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err  # the last line is the error; the lines before it, progress
    assert err.splitlines()[-1].startswith("roberta_fast.finetune: error: not enough disk space to save checkpoint "
                                           "step_00000013.pt")
    shutil.rmtree(out)
    monkeypatch.setattr(shutil, "disk_usage", real)
    monkeypatch.setattr(safetensors.torch, "save_file", no_space)
    assert finetune_main(finetune_argv(task, out)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    err = err.splitlines()[-1]
    assert err.startswith(f"roberta_fast.finetune: error: not enough disk space to export the model to "
                          f"'{out / 'model'}': it needs about ")
    assert "The checkpoint of step 13 is kept" in err
    assert [p.name for p in out.iterdir() if "model" in p.name] == []
    monkeypatch.undo()
    from roberta_fast import tasks

    monkeypatch.setattr(tasks, "write_text_atomic", no_space)  # room for the model, not its predictions
    assert finetune_main(finetune_argv(task, out)) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert "(writing the best epoch's predictions). The checkpoint of step 13 is kept" in err
    monkeypatch.undo()
    assert finetune_main(finetune_argv(task, out)) == 0
    assert (out / "model" / "model.safetensors").is_file()
    assert (out / "predictions" / "valid.tsv").read_text().count("\n") == 1 + 40  # evaluated again for them
    assert len([r for r in read_metrics(out / "metrics.jsonl", raw=True) if r["kind"] == "train"]) == 13


def test_the_space_margin_is_sized_to_the_checkpoint(dataset, tmp_path, monkeypatch):  # noqa: F811
    """A small checkpoint saves on a disk with a little more room than it takes (the margin
    was a fixed 1 MiB, which refused a 615 kB checkpoint with 1.4 MB free), and the estimate
    never falls short of what is written."""
    from roberta_fast.checkpoint import estimate_size
    from roberta_fast.trainer import Trainer

    trainer = Trainer(small_config(dataset, tmp_path / "run"), log=lambda *a: None)
    try:
        trainer.train_step(trainer.next_micro_batches())  # the optimizer's state exists
        state = trainer.state_dict()
    finally:
        trainer.close()
    size = CheckpointManager(tmp_path / "measure").save(1, state).stat().st_size
    assert size <= estimate_size(state) <= size + (128 << 10)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(*real(p)[:2], size + (128 << 10)))
    assert CheckpointManager(tmp_path / "small_disk").save(1, state).stat().st_size == size


# ---------------------------------------------------------------------- lying manifests
def lie_uint8(manifest):  # the ids are uint16; uint8 with twice the tokens matches every byte size
    manifest["dtype"] = "uint8"
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            shard["tokens"] *= 2


def lie_uint32(manifest):  # half the tokens of uint32: the byte sizes agree, the document index does not
    manifest["dtype"] = "uint32"  # in a shard of an even count (the corpus, CPython's docs, differs by version)
    split, shard = next(((name, s) for name, split in manifest["splits"].items() for s in split["shards"]
                         if s["tokens"] % 2 == 0), ("train", manifest["splits"]["train"]["shards"][0]))
    shard["tokens"] //= 2
    return split


def lie_bytes(manifest):
    manifest["splits"]["train"]["shards"][0]["bin_bytes"] += 2


def lie_max_id(manifest):
    manifest["splits"]["train"]["shards"][0]["max_id"] = manifest["vocab_size"]


LIES = {"uint8 for uint16": (lie_uint8, r"says the ids are 'uint8', which cannot hold the ids of its 1024-id vocabulary"),
        "uint32 for uint16": (lie_uint32, r"\d{5}.idx.npy' ends its documents at token \d+, but the manifest says "
                                          r"the shard holds \d+ tokens"),
        "byte size": (lie_bytes, r"records \d+ bytes for train/00000.bin, but \d+ tokens of uint16 are \d+ bytes"),
        "largest id": (lie_max_id, r"says train/00000.bin holds ids up to 1024, past its 1024-id vocabulary")}


@pytest.mark.parametrize("lie", LIES)
def test_a_lying_manifest_is_refused(dataset, tmp_path, lie):  # noqa: F811
    """A manifest whose dtype, sizes, token counts or largest ids disagree with each other, the
    files or the vocabulary is refused when the dataset opens, naming the fix (the files pass
    their checksums: only the manifest lies)."""
    import json

    from roberta_fast.data import PretrainingDataset

    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    manifest = json.loads((data / "manifest.json").read_text())
    tell, message = LIES[lie]
    if lie == "uint32 for uint16" and all(s["tokens"] % 2 for v in manifest["splits"].values() for s in v["shards"]):
        message = LIES["byte size"][1].replace("uint16", "uint32")  # odd counts: no byte size agrees with uint32
    split = tell(manifest) or "train"
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=message + r".*the dataset is damaged; rerun the `python -m roberta_fast"):
        PretrainingDataset(data, split, seq_len=32)


def test_preprocess_records_the_largest_id_of_each_shard(dataset, tmp_path):  # noqa: F811
    """preprocess records each shard's largest id; a dataset from an older preprocess (none
    recorded) loads with a note, and rerunning preprocess adds them."""
    import json

    import numpy as np

    from roberta_fast.data import verify_checksums
    from roberta_fast.preprocess import preprocess

    (tmp_path / "in.txt").write_text("".join(f"document {i} has some words in it.\n\n" for i in range(200)))
    args = ([tmp_path / "in.txt"], os.path.join(dataset, "tokenizer"), tmp_path / "ds")
    kw = dict(workers=1, progress=False, log=lambda m: None)
    manifest = preprocess(*args, **kw)
    shards = [s for split in manifest["splits"].values() for s in split["shards"]]
    assert [s["max_id"] for s in shards] == [int(np.fromfile(tmp_path / "ds" / s["bin"], np.uint16).max())
                                             for s in shards]
    for marker in (tmp_path / "ds" / "chunks").glob("*.json"):  # as an older preprocess left them
        stats = json.loads(marker.read_text())
        for info in stats["shards"].values():
            del info["max_id"]
        marker.write_text(json.dumps(stats))
    old = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    for shard in (s for split in old["splits"].values() for s in split["shards"]):
        del shard["max_id"]
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps(old))
    logged = []
    verify_checksums(tmp_path / "ds", log=logged.append)
    assert any(f"records no largest id for {len(shards)} shards" in m for m in logged)
    assert preprocess(*args, **kw)["splits"] == manifest["splits"]


# ---------------------------------------------------------------------- fault injection
class Killed(BaseException):
    """The process dies here: nothing after this moment runs (not an error anything handles)."""


def raw_pickle(path):
    torch.save(torch.load(path, weights_only=True), path, _use_new_zipfile_serialization=False)


def test_fault_injection_never_trains_on_damaged_state(dataset, runs, tmp_path, monkeypatch):  # noqa: F811
    """Training is killed at three seeded random moments (after a step's update, or halfway
    through writing its checkpoint); then, in a copy of one of them, its newest complete
    checkpoint is broken in one of the ways above, or left unsealed without a sidecar, or
    replaced by a raw pickle. Rerunning the same command either continues with losses equal to
    the uninterrupted run's bit for bit, or stops with a named error before any step: the raw
    pickle, or a lone checkpoint that cannot be resumed from."""
    from roberta_fast.integrity import HashingWriter

    rng = random.Random(28)
    moments = [(rng.randint(2, 5), rng.random() < 0.5) for _ in range(3)]  # (step, mid-write)
    for j, (kill_step, mid_write) in enumerate(moments):

        def half_write(writer, data):  # the kill lands halfway through this write
            view = memoryview(data).cast("B")
            writer.f.write(view[:len(view) // 2])
            raise Killed

        def kill(trainer):
            if trainer.step == kill_step:
                if not mid_write:
                    raise Killed
                monkeypatch.setattr(HashingWriter, "write", half_write)  # the save of this step dies

        with pytest.raises(Killed):
            run(small_config(dataset, tmp_path / f"killed{j}", save_every=1, export=False), on_step=kill)
        monkeypatch.undo()
        assert CheckpointManager(tmp_path / f"killed{j}" / "checkpoints").checkpoints()[-1][0] == kill_step - 1

    expected = train_losses(runs / "whole")
    ways = {**{name: corrupt for name, (corrupt, _) in DAMAGES.items()},
            "unsealed, no sidecar": without_sidecar(unsealed), "raw pickle": raw_pickle}
    outcomes = {}
    for i, (way, corrupt) in enumerate(ways.items()):
        out = tmp_path / f"run{i}"
        shutil.copytree(tmp_path / f"killed{i % len(moments)}", out)
        ckpts = CheckpointManager(out / "checkpoints").checkpoints()
        corrupt(ckpts[-1][1])
        before = train_losses(out)
        try:
            run(small_config(dataset, out, save_every=1, export=False))
        except ValueError as err:
            if way == "raw pickle":
                assert "is not a roberta_fast checkpoint: it is a raw pickle" in str(err)
            else:
                assert len(ckpts) == 1 and "can be resumed from" in str(err), (way, str(err))
            assert train_losses(out) == before  # not one step on damaged state
            outcomes[way] = f"stopped: {err}"
            continue
        assert way != "raw pickle" and len(ckpts) == 2, way
        assert train_losses(out) == expected, way
        outcomes[way] = "resumed exactly"
    assert sum(o == "resumed exactly" for o in outcomes.values()) >= len(ways) // 2, outcomes  # not vacuous
