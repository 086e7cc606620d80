"""Integrity under faults (issue 20): damaged checkpoints and shards, two trainers on one
--out, a full disk, a bad --init-from. The runs are test_train.py's small ones (CPU, seconds)."""
import errno
import os
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
from test_train import SMALL, dataset, run, small_argv, small_config, train_losses  # noqa: F401

from roberta_fast import checkpoint
from roberta_fast.checkpoint import CheckpointManager, DiskSpaceError, load_checkpoint, verify_checkpoint
from roberta_fast.metrics import read_metrics
from roberta_fast.train import main

Usage = namedtuple("Usage", "total used free")


def flip_middle(path, n=64):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_auto_resume_falls_back_past_a_damaged_checkpoint(dataset, tmp_path, capsys, damage):  # noqa: F811
    """Bytes flipped in (or the end cut off) the latest checkpoint: --resume PATH on it is a
    clear error; auto-resume names it, takes the previous one, and the continued losses equal
    an uninterrupted run's."""
    run(small_config(dataset, tmp_path / "whole", save_every=2))
    run(small_config(dataset, tmp_path / "split", save_every=2, stop_at=4))
    latest = tmp_path / "split" / "checkpoints" / "step_00000004.pt"
    if damage == "flipped":
        flip_middle(latest)
    else:
        latest.write_bytes(latest.read_bytes()[:1000])
    argv = small_argv(dataset) + ["--out", str(tmp_path / "split"), "--save-every", "2", "--log-every", "1",
                                  "--eval-every", "3", "--eval-batches", "2"]  # as SMALL
    capsys.readouterr()
    assert main(argv + ["--resume", str(latest)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint '{latest}' is damaged: its content does not match its checksum" in err
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"skipping a damaged checkpoint: checkpoint '{latest}' is damaged" in out
    assert "resumed from" in out and "step_00000002.pt at step 2" in out
    assert (tmp_path / "split" / "checkpoints" / "step_00000004.pt.damaged").is_file()  # set aside
    assert train_losses(tmp_path / "split") == train_losses(tmp_path / "whole")


def test_checkpoints_carry_a_checksum_and_old_ones_load_with_a_note(tmp_path, capsys):
    ckpt = CheckpointManager(tmp_path)
    path = ckpt.save(1, {"step": 1, "w": torch.ones(10)})
    digest = (tmp_path / "step_00000001.pt.sha256").read_text()
    assert digest.endswith("  step_00000001.pt\n")  # sha256sum -c format
    assert verify_checkpoint(path)
    (tmp_path / "step_00000001.pt.sha256").unlink()
    assert load_checkpoint(path)["step"] == 1
    assert "has no checksum file (written by an older roberta_fast): loaded unverified" in capsys.readouterr().err


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
    assert f"another trainer (pid {os.getpid()} on " in proc.stderr and "pass another --out" in proc.stderr
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
    assert verify_checkpoint(ckpts / "step_00000002.pt")
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
    from roberta_fast import RobertaConfig, RobertaForMaskedLM

    model_dir = tmp_path / "model"
    cfg = RobertaConfig.preset("tiny", vocab_size=1024, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)
    RobertaForMaskedLM(cfg).save_pretrained(model_dir)
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
