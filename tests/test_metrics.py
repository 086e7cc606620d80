"""MetricsLogger: JSONL records (exact floats, NaN -> null), append-only resume, plot."""
import json
import math
import os

import pytest

from roberta_fast.metrics import MetricsLogger, plot_losses, read_metrics


def test_records_and_resume_rollback(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=10, progress=False, tensorboard=False)
    for step in range(1, 7):
        log.log({"kind": "train", "step": step, "loss": 1.0 / 3 + step, "mfu": math.nan})
    log.log({"kind": "eval", "step": 5, "loss": 2.5})
    log.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 7 and records[0]["loss"] == 1.0 / 3 + 1  # no rounding: resume compares exactly
    assert records[0]["mfu"] is None
    # a run resumed from step 4 hides what was logged after it, then appends
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # a line torn by a kill
    log = MetricsLogger(tmp_path, total_steps=10, start_step=4, progress=False, tensorboard=False)
    log.log({"kind": "train", "step": 5, "loss": 9.0})
    log.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in records] == [("train", s) for s in (1, 2, 3, 4, 5)]
    assert records[-1]["loss"] == 9.0
    raw = read_metrics(tmp_path / "metrics.jsonl", raw=True)  # nothing was deleted
    assert len(raw) == 7 + 2 and raw[-2] == {"kind": "resume", "step": 4}
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[-3] == '{"kind": "train", "st'  # the torn line was ended, not glued to the marker


def test_a_run_started_over_drops_every_earlier_record(tmp_path):
    """A run with no checkpoint to resume (killed before its first one) redoes step 0's evaluation:
    from_scratch marks step -1, so read_metrics holds that evaluation once, not twice."""
    log = MetricsLogger(tmp_path, total_steps=10, progress=False, tensorboard=False)
    log.log({"kind": "eval", "step": 0, "loss": 7.0})
    log.log({"kind": "train", "step": 1, "loss": 6.0})
    log.close()
    log = MetricsLogger(tmp_path, total_steps=10, progress=False, tensorboard=False, from_scratch=True)
    log.log({"kind": "eval", "step": 0, "loss": 7.5})
    log.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"kind": "eval", "step": 0, "loss": 7.5}]
    assert len(read_metrics(tmp_path / "metrics.jsonl", raw=True)) == 4


def test_resume_appends_and_never_rewrites(tmp_path):
    """A resumed logger appends: lines another process writes through its open file
    (e.g. a run still going) land in the same file, and the earlier bytes stay as they were."""
    log = MetricsLogger(tmp_path, total_steps=10, progress=False, tensorboard=False)
    for step in (1, 2, 3):
        log.log({"kind": "train", "step": step, "loss": 1.0})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    resumed = MetricsLogger(tmp_path, total_steps=10, start_step=2, progress=False, tensorboard=False)
    log.log({"kind": "train", "step": 4, "loss": 2.0})  # the other writer goes on
    resumed.log({"kind": "train", "step": 3, "loss": 3.0})
    log.close()
    resumed.close()
    after = (tmp_path / "metrics.jsonl").read_bytes()
    assert after.startswith(before)
    assert {"kind": "train", "step": 4, "loss": 2.0} in read_metrics(tmp_path / "metrics.jsonl", raw=True)


def test_tensorboard_purges_only_the_steps_a_resume_redoes(tmp_path, monkeypatch):
    """Resumed from step 4, TensorBoard drops the records of steps 5 on (redone), not step 4's own
    (its train line and eval come before the checkpoint and are not logged again): purge_step 5."""
    import sys
    import types

    made = []
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = lambda log_dir, purge_step=None: made.append(purge_step) or types.SimpleNamespace(
        add_scalar=lambda *a: None, close=lambda: None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    MetricsLogger(tmp_path, total_steps=10, progress=False).close()
    MetricsLogger(tmp_path, total_steps=10, start_step=4, progress=False).close()
    MetricsLogger(tmp_path, total_steps=10, progress=False, from_scratch=True).close()  # all redone
    assert made == [None, 5, 0]


class FakeWandb:
    """The part of the wandb module MetricsLogger uses, recording calls. `refuse` makes init fail as W&B
    does when it cannot start a run (e.g. not logged in)."""

    class errors:
        class Error(Exception):
            pass

    def __init__(self, refuse=None):
        self.refuse, self.inits, self.logged, self.finished, self.metrics = refuse, [], [], [], []

    def init(self, **kwargs):
        if self.refuse:
            raise self.errors.Error(self.refuse)
        self.inits.append(kwargs)
        fake = self
        run_id = kwargs["id"] or f"new{len(self.inits)}"

        class Run:
            id = run_id

            def define_metric(self, name, step_metric=None, step_sync=None):
                fake.metrics.append((name, step_metric))

            def log(self, data):
                fake.logged.append((data.pop("step"), data))

            def finish(self, exit_code=0):
                fake.finished.append(exit_code)
        return Run()


def test_wandb_run_follows_the_output_directory_across_resumes(tmp_path, monkeypatch):
    """--wandb-project: the same scalars as TensorBoard, under kind/name, against the training step; the
    run's id kept in <out>/wandb_run_id, so a resumed logger goes on with that W&B run and sends the steps
    it redoes again (W&B drops nothing: not an evaluation, not a changed LR); a run from step 0 starts a
    new W&B run; a failed run is marked failed."""
    import sys

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_NAME", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    config = {"lr": 1e-3, "out": tmp_path, "wandb_project": "bio"}
    log = MetricsLogger(tmp_path, 10, progress=False, tensorboard=False, wandb_project="bio", run_config=config)
    log.log({"kind": "eval", "step": 0, "loss": 7.0, "tokens": 12})
    log.log({"kind": "train", "step": 2, "loss": 6.0, "lr": 1e-4, "note": "text", "finite": True})
    log.log({"kind": "train", "step": 6, "loss": 5.0})  # (the run dies here, after its step-4 checkpoint)
    log.close(failed=True)
    first = fake.inits[0]
    assert first["project"] == "bio" and first["id"] is None and first["name"] == tmp_path.name
    assert first["dir"] == str(tmp_path)
    assert first["config"] == {"lr": 1e-3, "out": str(tmp_path), "wandb_project": "bio"}  # a path as text
    assert fake.metrics == [("step", None), ("*", "step")]
    assert fake.logged == [(0, {"eval/loss": 7.0, "eval/tokens": 12}), (2, {"train/loss": 6.0, "train/lr": 1e-4}),
                           (6, {"train/loss": 5.0})]
    assert (tmp_path / "wandb_run_id").read_text() == "new1\n" and fake.finished == [1]

    fake.logged.clear()
    log = MetricsLogger(tmp_path, 10, start_step=4, progress=False, tensorboard=False, wandb_project="bio")
    for step in (5, 6):  # redone from the step-4 checkpoint
        log.log({"kind": "train", "step": step, "loss": float(step)})
    log.log({"kind": "eval", "step": 6, "loss": 4.5})
    log.close()
    assert fake.inits[1]["id"] == "new1" and fake.inits[1]["resume"] == "allow"
    assert fake.logged == [(5, {"train/loss": 5.0}), (6, {"train/loss": 6.0}), (6, {"eval/loss": 4.5})]
    assert fake.finished == [1, 0]
    log.close()  # a second close does nothing
    assert fake.finished == [1, 0]

    MetricsLogger(tmp_path, 10, start_step=0, progress=False, tensorboard=False, wandb_project="bio").close()
    assert fake.inits[2]["id"] is None and (tmp_path / "wandb_run_id").read_text() == "new3\n"
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # W&B's own variable: its files go there
    MetricsLogger(tmp_path, 10, progress=False, tensorboard=False, wandb_project="bio").close()
    assert fake.inits[3]["dir"] is None


def test_wandb_that_cannot_start_a_run_says_what_to_do(tmp_path, monkeypatch):
    """Not logged in (W&B's usual first error): a ValueError in one line (the CLIs' exit 2), naming the fixes."""
    import sys

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(refuse="No API key configured"))
    with pytest.raises(ValueError, match="No API key configured. Log in with `wandb login`.*WANDB_MODE=offline"):
        MetricsLogger(tmp_path, 10, progress=False, tensorboard=False, wandb_project="bio")


def test_wandb_project_without_wandb_names_the_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, 10, progress=False, tensorboard=False, wandb_project="bio")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_is_one_disk_space_error(tmp_path):
    """metrics.jsonl on a full disk (/dev/full: every write is ENOSPC): DiskSpaceError in one line
    naming the directory (the trainer's exit 1), and close() does not raise the same error again."""
    from roberta_fast.checkpoint import DiskSpaceError

    os.symlink("/dev/full", tmp_path / "metrics.jsonl")
    log = MetricsLogger(tmp_path, total_steps=10, progress=False, tensorboard=False)
    with pytest.raises(DiskSpaceError, match=r"no space left on the disk of '.*' \(writing metrics.jsonl\): free "
                                             "some space, then rerun the same command"):
        log.log({"kind": "train", "step": 1, "loss": 1.0})
    log.close()


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "rank1", total_steps=5, enabled=False)
    log.log({"kind": "train", "step": 1, "loss": 1.0})
    log.close()
    assert not (tmp_path / "rank1").exists()


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    log = MetricsLogger(tmp_path, total_steps=3, progress=False, tensorboard=False)
    for step, loss in ((1, 3.0), (2, 2.0), (3, 1.5)):
        log.log({"kind": "train", "step": step, "loss": loss})
    log.log({"kind": "eval", "step": 3, "loss": 1.7})
    log.close()
    png = plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12), ("Tesla V100-SXM2-16GB", 125e12),
    ("Tesla V100-PCIE-32GB", 112e12), ("Tesla V100S-PCIE-32GB", 130e12), ("Tesla T4", 65e12),
])
def test_mfu_peak_by_device_name(name, peak):
    """torch.cuda.get_device_name() strings -> the dense bf16/fp16 datasheet peak; NaN elsewhere."""
    from roberta_fast.config import RobertaConfig
    from roberta_fast.model import estimate_mfu, training_flops

    cfg = RobertaConfig.preset("base")
    flops = training_flops(cfg, 1e5, 1.5e4, 512)
    assert estimate_mfu(cfg, 1e5, 1.5e4, 512, name) == pytest.approx(flops / peak)
    # full rows attend seq_len keys per token; rows of 128 (or packed documents) a quarter of that
    assert training_flops(cfg, 1e5, 1.5e4, 512, attended_pairs=512 * 1e5) == flops
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * 1e5 * (512 - 128)
    assert training_flops(cfg, 1e5, 1.5e4, 512, attended_pairs=128 * 1e5) == pytest.approx(flops - attention)
    assert math.isnan(estimate_mfu(cfg, 1e5, 1.5e4, 512, "cpu"))


class _FullDiskWriter:
    """A SummaryWriter whose event file is on a full disk: its writer thread's ENOSPC surfaces in
    add_scalar and again in close(), as torch's does."""
    def __init__(self, *args, **kwargs):
        pass

    def add_scalar(self, *args):
        raise OSError(28, "No space left on device")

    close = add_scalar


def test_tensorboard_on_a_full_disk_is_one_disk_space_error(tmp_path, monkeypatch, capsys):
    import sys
    import types

    from roberta_fast.checkpoint import DiskSpaceError

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _FullDiskWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    log = MetricsLogger(tmp_path, total_steps=10, progress=False)
    with pytest.raises(DiskSpaceError, match=r"no space left on the disk of '.*' \(writing TensorBoard scalars\)"):
        log.log({"kind": "train", "step": 1, "loss": 1.0})
    log.close()  # no second error
    assert "the last TensorBoard scalars were not written: no space left" in capsys.readouterr().err


def test_tensorboard_missing_is_said_once(tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kw):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError(name)
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    log = MetricsLogger(tmp_path, total_steps=10, progress=False)
    log.log({"kind": "train", "step": 1, "loss": 1.0})
    log.close()
    assert capsys.readouterr().err.count("TensorBoard scalars skipped: pip install tensorboard") == 1
    MetricsLogger(tmp_path, total_steps=10, progress=False, tensorboard=False).close()  # --no-tensorboard: silent
    assert "TensorBoard" not in capsys.readouterr().err


def test_a_log_file_gets_lines_not_bar_frames(tmp_path, capsys):
    """stderr redirected to a file (a batch job): one line per logged step even with progress on;
    the bar only draws on a terminal."""
    log = MetricsLogger(tmp_path, total_steps=10, progress=True, tensorboard=False)
    for step in (5, 10):
        log.advance(step)
        log.log({"kind": "train", "step": step, "loss": 2.0, "tokens_per_s": 1000.0, "lr": 1e-4})
    log.close()
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines() == ["step 5: loss 2, tok/s 1000, lr 0.0001",
                                                    "step 10: loss 2, tok/s 1000, lr 0.0001"]
