"""Training reports: a tqdm bar, `<out>/metrics.jsonl`, TensorBoard, Weights & Biases and a final loss plot.

    log = MetricsLogger(out_dir, total_steps=600, start_step=0)
    log.log({"kind": "train", "step": 10, "loss": 7.1, ...})    # one JSON line per call
    log.advance(step)                                            # move the bar
    log.close(); plot_losses(out_dir / "metrics.jsonl", out_dir / "loss.png")

Each line of metrics.jsonl is one JSON object with a "kind" ("train" or "eval") and a
"step"; non-finite numbers are written as null. The file is only ever appended to, never
rewritten, so nothing another process wrote to it is lost. A resumed run rolls back to its
checkpoint's step s and redoes the steps after it, so `MetricsLogger(..., start_step=s)`
appends a marker line {"kind": "resume", "step": s}; `read_metrics` drops the records
before a marker whose step is past s (the steps redone), so the file reads as if the run
had never stopped, while the raw file (`read_metrics(path, raw=True)`) keeps every line
ever written, the abandoned steps included. A run that starts over (`from_scratch=True`: no
checkpoint, so it redoes step 0's evaluation too) marks step -1, dropping every earlier record.
TensorBoard scalars are written when the `tensorboard` package is installed, the PNG plot when
matplotlib is. With `wandb_project`, the same scalars go to a Weights & Biases run (`pip install wandb`;
its own settings from the environment: WANDB_MODE=offline, WANDB_ENTITY, WANDB_NAME, WANDB_DIR, ...),
named after the output directory, against the training step (W&B's "step" metric). Its id is kept in
`<out>/wandb_run_id`: a resumed run goes on with the same W&B run and a run that starts at step 0
starts a new one. W&B keeps every record sent, as the raw metrics.jsonl does: the steps a resumed run
redoes after its checkpoint are logged again (the same values, unless the run was resumed with another
schedule), so W&B drops nothing, not an evaluation of a step nor a changed learning rate.
Only rank 0 reports; other ranks construct the logger with enabled=False.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import torch

from .checkpoint import DiskSpaceError
from .files import atomic_path, write_text_atomic
from .integrity import is_no_space

METRICS_FILE = "metrics.jsonl"
WANDB_RUN_ID_FILE = "wandb_run_id"


def _clean(value):
    """JSON-safe value: floats kept exactly (shortest round-trip repr), non-finite -> None."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | os.PathLike, raw: bool = False) -> list[dict]:
    """The records of a metrics.jsonl as the run's history: each "resume" marker drops the
    records logged after its step before it (steps redone); raw=True: every line as written.
    A torn line, from a kill, is ignored."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "resume" and not raw:
            records = [r for r in records if r.get("step", 0) <= record["step"]]
        else:
            records.append(record)
    return records


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: GPU allocations on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux
    except ImportError:  # pragma: no cover - non-POSIX
        return math.nan


class MetricsLogger:
    """Progress bar, JSONL log and TensorBoard writer of one (rank-0) training process."""

    def __init__(self, out_dir: str | os.PathLike, total_steps: int, start_step: int = 0,
                 enabled: bool = True, progress: bool = True, tensorboard: bool = True, from_scratch: bool = False,
                 wandb_project: str | None = None, run_config: dict | None = None):
        self.enabled = enabled
        self.path = Path(out_dir) / METRICS_FILE
        self.bar = self.writer = self._file = self.wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._mark_resume(-1 if from_scratch else start_step)  # from scratch: step 0's records are redone too
        if progress and sys.stderr.isatty():  # a log file gets one line per logged step, not bar frames
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge what a resumed run redoes: the steps after its checkpoint's, not that step's own records
                purge = 0 if from_scratch else start_step + 1 if start_step else None
                self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"), purge_step=purge)
            except ImportError:  # tensorboard not installed: JSONL only
                self.writer = None
                self.write("note: TensorBoard scalars skipped: pip install tensorboard for them "
                           "(--no-tensorboard silences this)")
        if wandb_project:
            self.wandb = _wandb_run(Path(out_dir), wandb_project, run_config, new=from_scratch or start_step == 0)

    def _mark_resume(self, step: int) -> None:
        """Append a "resume" marker at `step` to a file that already holds records (after ending
        a line torn by a kill, so the marker is a line of its own)."""
        size = self.path.stat().st_size
        if size == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(size - 1)
            torn = f.read(1) != b"\n"
        self._append(("\n" if torn else "") + json.dumps({"kind": "resume", "step": step}) + "\n")

    def _append(self, text: str) -> None:
        """Write and flush `text`; a full disk is DiskSpaceError in one line, not an OSError traceback."""
        with self._no_space_is_one_line(self.path.name):
            self._file.write(text)
            self._file.flush()

    @contextlib.contextmanager
    def _no_space_is_one_line(self, writing: str):
        try:
            yield
        except OSError as err:
            if not is_no_space(err):
                raise
            raise DiskSpaceError(f"no space left on the disk of {str(self.path.parent)!r} (writing {writing}): "
                                 "free some space, then rerun the same command to go on from the last "
                                 "checkpoint") from None

    def log(self, record: dict) -> None:
        """Append one record (needs "kind" and "step") to the JSONL file and TensorBoard."""
        if not self.enabled:
            return
        record = {k: _clean(v) for k, v in record.items()}
        self._append(json.dumps(record) + "\n")
        if self.writer is not None:
            with self._no_space_is_one_line("TensorBoard scalars"):  # (the writer's thread's error, raised here)
                for k, v in record.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                        self.writer.add_scalar(f"{record['kind']}/{k}", v, record["step"])
        if self.wandb is not None:  # against our step, not W&B's own counter (which a resume cannot go back on)
            self.wandb.log({"step": record["step"], **{f"{record['kind']}/{k}": v for k, v in record.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}})
        if record["kind"] == "train":
            shown = {"loss": record.get("loss"), "sbo": record.get("sbo_loss"), "tok/s": record.get("tokens_per_s"),
                     "lr": record.get("lr")}  # sbo: with the span boundary objective only
            shown = {k: f"{v:.4g}" for k, v in shown.items() if v is not None}
            if self.bar is not None:
                self.bar.set_postfix(shown, refresh=False)
            else:  # no bar (logs to a file): one line per logged step
                self.write(f"step {record['step']}: " + ", ".join(f"{k} {v}" for k, v in shown.items()))

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def advance(self, step: int) -> None:
        """Move the progress bar to `step`."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def close(self, failed: bool = False) -> None:
        """End the reports (failed: the W&B run is marked failed, not finished); a second call does nothing."""
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if failed else 0)
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as err:
                if not is_no_space(err):
                    raise
                print(f"note: the last TensorBoard scalars were not written: no space left on the disk of "
                      f"{str(self.path.parent)!r}", file=sys.stderr)
        if self._file is not None:
            try:
                self._file.close()
            except OSError as err:  # the line a full disk refused is still buffered: already reported
                if not is_no_space(err):
                    raise
        self.bar = self.writer = self._file = self.wandb = None


def wandb_missing(project: str | None) -> str | None:
    """The error for --wandb-project without the wandb package (checked with the other options, before
    a run starts), else None."""
    if not project or sys.modules.get("wandb") is not None or (
            "wandb" not in sys.modules and importlib.util.find_spec("wandb") is not None):  # (None there: blocked)
        return None
    return (f"--wandb-project {project} needs the wandb package: pip install wandb (then `wandb login`, or "
            "WANDB_MODE=offline to log without an account), or leave --wandb-project out")


def _wandb_run(out_dir: Path, project: str, run_config: dict | None, new: bool):
    """The W&B run of `out_dir`: a new one (its id written to <out>/wandb_run_id), or the one whose id
    that file holds, resumed."""
    try:
        import wandb
    except ImportError as err:
        raise ImportError(wandb_missing(project) or f"--wandb-project {project}: import wandb failed: {err}") from err
    id_file = out_dir / WANDB_RUN_ID_FILE
    run_id = None if new or not id_file.is_file() else id_file.read_text(encoding="utf-8").strip()
    name = None if os.environ.get("WANDB_NAME") else out_dir.resolve().name
    try:
        run = wandb.init(project=project, id=run_id or None, resume="allow" if run_id else None, name=name,
                         dir=None if os.environ.get("WANDB_DIR") else str(out_dir), config=_jsonable(run_config or {}))
    except wandb.errors.Error as err:  # not logged in, no network, a project it may not write to
        raise ValueError(f"W&B could not start a run in project {project!r}: {str(err).rstrip('.')}. Log in with `wandb login` "
                         "(or set WANDB_API_KEY), log offline with WANDB_MODE=offline, or leave --wandb-project "
                         "out") from None
    run.define_metric("step")
    run.define_metric("*", step_metric="step", step_sync=True)
    if run.id != run_id:
        write_text_atomic(id_file, run.id + "\n")
    return run


def _jsonable(config: dict) -> dict:
    """A run's options as W&B's config takes them (paths as strings)."""
    return {k: v if v is None or isinstance(v, (bool, int, float, str, list, dict)) else str(v)
            for k, v in config.items()}


def plot_losses(metrics_path: str | os.PathLike, png_path: str | os.PathLike) -> Path | None:
    """PNG of the training and validation loss against step; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and r.get("loss") is not None]
    valid = [(r["step"], r["loss"]) for r in records if r.get("kind") == "eval" and r.get("loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train MLM loss", lw=1)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation MLM loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / predicted token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return png_path
