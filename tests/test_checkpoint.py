"""Checkpoints: atomic writes (a kill mid-write leaves the previous one loadable),
keep-last-k, latest, clear errors, and the stop-signal flag."""
import os
import signal
import subprocess
import sys
import textwrap

import random

import numpy as np
import pytest
import torch
from malicious_checkpoint import write_malicious_checkpoint

from roberta_fast.checkpoint import CheckpointManager, StopSignal, atomic_torch_save, load_checkpoint
from roberta_fast.trainer import rng_state, set_rng_state


def state(step):
    return {"step": step, "weights": torch.full((3,), float(step))}


def test_save_keeps_the_last_k_and_finds_the_latest(tmp_path):
    ckpt = CheckpointManager(tmp_path, keep=2)
    assert ckpt.latest() is None
    for step in (5, 10, 15):
        ckpt.save(step, state(step))
    assert [s for s, _ in ckpt.checkpoints()] == [10, 15]
    assert ckpt.latest().name == "step_00000015.pt"
    loaded = load_checkpoint(ckpt.latest())
    assert loaded["step"] == 15 and torch.equal(loaded["weights"], torch.full((3,), 15.0))
    assert load_checkpoint(tmp_path)["step"] == 15  # a directory: its latest
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_kill_during_write_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL in the middle of writing step 2: step 1 stays the latest and loads."""
    script = textwrap.dedent(f"""
        import os, signal, torch
        from roberta_fast import checkpoint
        ckpt = checkpoint.CheckpointManager({str(tmp_path)!r}, keep=3)
        ckpt.save(1, {{"step": 1, "w": torch.ones(1000)}})
        real_save = torch.save
        def dying_save(obj, f):
            f.write(b"half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.torch.save = dying_save
        ckpt.save(2, {{"step": 2, "w": torch.zeros(1000)}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers, "the killed writer should have left its temporary file"
    ckpt = CheckpointManager(tmp_path, keep=3)
    assert ckpt.latest().name == "step_00000001.pt"
    assert torch.equal(load_checkpoint(ckpt.latest())["w"], torch.ones(1000))
    ckpt.save(3, state(3))  # the next save clears the debris
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert [s for s, _ in ckpt.checkpoints()] == [1, 3]


def test_failed_write_removes_its_temp_file(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_torch_save({"step": 1, "x": Unpicklable()}, tmp_path / "step_00000001.pt")
    assert os.listdir(tmp_path) == []


def test_run_lock_on_a_full_disk_is_one_line_naming_the_directory(tmp_path, monkeypatch):
    """No room for run.lock's line (a full disk at start): a ValueError (exit 2) naming --out and
    the way out, not an OSError traceback."""
    import builtins
    import errno

    from roberta_fast import checkpoint

    class FullDisk:  # a real file (flock works on it) whose writes hit ENOSPC
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "open", lambda *a, **k: FullDisk(builtins.open(*a, **k)), raising=False)
    with pytest.raises(ValueError, match=r"no space left on the disk of '.*' \(writing its run.lock\): free some "
                                         r"space, or pass another --out"):
        checkpoint.RunLock(tmp_path).acquire()


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    bad = tmp_path / "step_00000001.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is damaged: it does not start as a zip archive"):
        load_checkpoint(bad)
    atomic_torch_save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a roberta_fast training checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no checkpoint"):
        load_checkpoint(tmp_path / "empty")
    with pytest.raises(ValueError, match="keep must be"):
        CheckpointManager(tmp_path, keep=0)


def test_stop_signal_sets_a_flag_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop:
        assert stop.requested is None
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before
    with StopSignal() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.requested == "SIGINT"
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C interrupts at once
            signal.raise_signal(signal.SIGINT)


def test_a_checkpoint_that_runs_code_is_refused_and_never_run(tmp_path):
    path = tmp_path / "checkpoints" / "step_00000005.pt"
    marker = tmp_path / "pwned"
    write_malicious_checkpoint(path, marker)
    for target in (path, path.parent):  # a file, and a directory's latest
        with pytest.raises(ValueError, match=r"refusing to load checkpoint .*step_00000005.pt.*posix.system"
                                             r".*--trust-checkpoint"):
            load_checkpoint(target)
    assert not marker.exists(), "loading the checkpoint ran its code"
    torch.load(path, weights_only=False)  # the payload is live: the full unpickler runs it
    assert marker.exists()


def test_the_rng_state_we_save_loads_weights_only_and_restores_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached Gaussian in NumPy's legacy state
    CheckpointManager(tmp_path).save(1, {"step": 1, "rng": [rng_state(torch.device("cpu"))]})
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "step_00000001.pt") == []
    state = load_checkpoint(tmp_path)
    draw = lambda: (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist())  # noqa: E731
    expected = draw()
    set_rng_state(state["rng"][0], torch.device("cpu"))
    assert draw() == expected


def test_a_checkpoint_in_the_old_format_needs_trust(tmp_path):
    """Before weights-only checkpoints, NumPy's RNG state was saved as its legacy tuple
    (an ndarray inside): such a file is refused by default and loads with trust=True."""
    np.random.seed(7)
    old = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    torch.save({"step": 3, "rng": [old]}, tmp_path / "step_00000003.pt")
    with pytest.raises(ValueError, match=r"numpy.*older roberta_fast versions.*--trust-checkpoint"):
        load_checkpoint(tmp_path)
    state = load_checkpoint(tmp_path, trust=True)
    expected = np.random.rand(4)
    set_rng_state(state["rng"][0], torch.device("cpu"))
    assert np.array_equal(np.random.rand(4), expected)
