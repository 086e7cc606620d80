"""Small helpers shared by the kernel benchmarks: device facts, copy bandwidth, timing, JSON.

    import _common as bc                      # benchmarks/ is the script's directory
    bc.use_interpreter_without_gpu()          # before roberta_fast.kernels is imported
    args = bc.parser("what this measures").parse_args()
    device = bc.default_device()
    copy = bc.copy_bandwidth_gbs(device)      # measured device-to-device copy, GB/s
    times = {"fused": bc.fwd_bwd_ms(fn, inputs, dy, device), "eager": ...}  # {pass: ms}
    rows = bc.bandwidth_rows({"N": 768}, times, {"fwd": ..., ...}, copy)  # GB/s, %copy
    bc.print_rows(rows, [...]); bc.write_json(args.json, bc.environment(device), rows)
    bc.sig(x)                                 # x to 3 significant digits, for tables

Timing uses triton.testing.do_bench (CUDA, median) or a wall-clock median on the CPU,
where the numbers only prove the script runs (the Triton interpreter is not fast).
Bandwidth is reported as the bytes an op must move over its time, beside the copy
bandwidth measured in the same run: that ratio, not a datasheet figure, is the target.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from roberta_fast.files import write_text_atomic  # (no kernels: the interpreter switch below still comes first)


def use_interpreter_without_gpu():
    """Without CUDA, run Triton kernels in its CPU interpreter (must precede importing triton)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def parser(description):
    """argparse parser with the options every kernel benchmark takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny shapes (runs on the CPU under the interpreter)")
    p.add_argument("--json", metavar="PATH", help="also write the results to this JSON file")
    return p


def default_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_facts(device):
    """What the numbers were measured on."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "sm_count": props.multi_processor_count,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}"}
    return {"type": "cpu", "name": _cpu_model() or platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1",
            **cpu_isa()}


def _cpu_model():
    """The CPU's model name from /proc/cpuinfo (Linux), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def cpu_isa():
    """The instruction sets CPU timings depend on: torch's vector level, and whether int8 products sum
    without saturation (VNNI, AMX) and bf16 matmuls run in hardware (AVX512-BF16, AMX). The int8 and
    bf16 figures of a CPU without them do not carry over to one with them, nor back."""
    probe = lambda name: bool(getattr(torch.cpu, name, lambda: False)())  # noqa: E731 (private, may be absent)
    return {"capability": torch.backends.cpu.get_cpu_capability(), "vnni": probe("_is_vnni_supported"),
            "avx512_bf16": probe("_is_avx512_bf16_supported"), "amx": probe("_is_amx_tile_supported")}


def _git_commit():
    """HEAD (with -dirty when tracked files changed); where the tree is a copy without .git (the
    GPU machine's), ROBERTA_FAST_COMMIT, which the command that starts the run sets; else "unknown"."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("ROBERTA_FAST_COMMIT") or "unknown"


def environment(device):
    """Device, commit, date and versions, for the JSON record."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": device_facts(device),
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda, "triton": triton_version},
        "argv": sys.argv[1:],
        # the allocator settings a run was given (glibc's MALLOC_* tunables, a preloaded malloc): on the CPU
        # they change every PyTorch contender's time (docs/inference.md, "The allocator")
        "allocator_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"},
    }


def onnxruntime_cpu_session(path):
    """An onnxruntime CPU session of the model at `path`: torch's thread count, all graph optimisations,
    and no busy-waiting between runs: spinning pool threads would take the cores from the contenders
    timed after it (measured: every PyTorch contender ~100x slower on 2 cores with spinning on)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def bench_ms(fn, device, warmup=25, rep=100):
    """Median milliseconds of one call of fn (warmup/rep in ms on CUDA, in calls on the CPU)."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device, nbytes=None):
    """Measured device-to-device copy bandwidth in GB/s (read + write bytes over time)."""
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**24)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


def fwd_bwd_ms(fn, inputs, dy, device):
    """Median ms of fn(*inputs) forward, backward (grads of inputs needing them) and both."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    y = fn(*inputs)
    return {
        "fwd": bench_ms(lambda: fn(*inputs), device),
        "bwd": bench_ms(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True), device),
        "fwd+bwd": bench_ms(lambda: torch.autograd.grad(fn(*inputs), leaves, dy), device),
    }


def bandwidth_rows(case, times, nbytes, copy_gbs, peer="eager"):
    """Table rows for one case: ms, GB/s, % of copy bandwidth, and speed-up over `peer`.

    case: dict describing the shape; times: {impl: {pass: ms}} from fwd_bwd_ms;
    nbytes: {pass: bytes the op must move at least}.
    """
    rows = []
    for impl, by_pass in times.items():
        for name, ms in by_pass.items():
            gbs = nbytes[name] / ms / 1e6
            rows.append({**case, "impl": impl, "pass": name, "ms": sig(ms),
                         "GB/s": sig(gbs), "%copy": sig(100 * gbs / copy_gbs),
                         f"x_vs_{peer}": sig(times[peer][name] / ms)})
    return rows


def sig(value, digits=3):
    """value rounded to `digits` significant digits, for readable tables."""
    return float(f"{value:.{digits}g}")


_sig = sig  # earlier name, still used by some benchmarks


def print_rows(rows, columns):
    """Print dicts as an aligned text table."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def record_path(args, op, device):
    """--json, or for a full GPU run the record file results/bench_<op>-<device name>-<date>.json (the name
    results/README.md gives kernel benchmarks' files, which throughput.py --refresh-record tabulates); else None."""
    if args.json is not None or device.type != "cuda" or args.quick:
        return args.json
    stamp = environment(device)["date"].replace(":", "").replace("+0000", "Z")
    name = device_facts(device)["name"].replace(" ", "_")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"bench_{op}-{name}-{stamp}.json")


def write_json(path, env, results, **extra):
    """Write {"environment", "results", **extra} to path atomically (temp file + rename)."""
    payload = {"environment": env, **extra, "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")
