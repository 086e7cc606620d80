"""Peak memory of one training step with and without activation checkpointing
(`model.gradient_checkpointing_enable()`, `--activation-checkpointing` in the CLIs), and its time.

    python benchmarks/bench_activation_checkpointing.py                 # base, seq 512, batch 4
    python benchmarks/bench_activation_checkpointing.py --model large --batch 8 --json out.json
    python benchmarks/bench_activation_checkpointing.py --quick         # tiny model: proves it runs

Each setting runs in a fresh process, on the same weights and batch (MLM, 15% of tokens
predicted, dropout on, fp32, the backend `auto` picks: fused kernels on a GPU).
Measured: on a GPU, `torch.cuda.max_memory_allocated` over the step (what the caching
allocator handed out: weights, gradients, activations); on the CPU, the process's peak
resident set over the step (VmHWM, reset through /proc/self/clear_refs after a warm-up
step; large buffers mmap-ed so that freed memory leaves at once) minus its resident set
before it, so the interpreter, torch and the weights are left out (Linux only). The saving is the difference between the two settings
in the same run; the step time (median of --steps) gives the recompute's cost.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as bc  # noqa: E402

SETTINGS = ("off", "on")


def measure(args) -> dict:
    """One setting, in this process: peak memory and step time of forward + backward."""
    import roberta_fast as rf

    device = torch.device(args.device)
    torch.manual_seed(0)
    config = rf.RobertaConfig.preset(args.model, max_position_embeddings=max(514, args.seq_len + 2))
    model = rf.RobertaForMaskedLM(config).to(device).train()
    if args.setting == "on":
        model.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (args.batch, args.seq_len), generator=g).to(device)
    labels = torch.where(torch.rand(ids.shape, generator=g).to(device) < 0.15, ids, -100)

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=labels, masked_only=True).loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: lazy imports, allocator pools, gradients allocated
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        peak, what = torch.cuda.max_memory_allocated(), "CUDA max_memory_allocated"
    else:
        with open("/proc/self/clear_refs", "w") as f:  # resets the peak resident set (VmHWM) to now
            f.write("5")
        before = _status_bytes("VmRSS")
        step()
        peak, what = _status_bytes("VmHWM"), "CPU peak RSS (VmHWM)"
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"setting": args.setting, "memory": what, "before_bytes": before, "peak_bytes": peak,
            "step_peak_bytes": peak - before, "step_s": statistics.median(times)}


def _status_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident since the last reset) of this process."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="base", help="RobertaConfig preset (default base)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="timed steps per setting (the median is reported)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny model, seq 64: only proves the script runs")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--setting", choices=SETTINGS, help=argparse.SUPPRESS)  # a child process's one setting
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.seq_len, args.batch, args.steps = "tiny", 64, 2, 1
    if args.setting:
        print(json.dumps(measure(args)))
        return 0
    rows = []
    for setting in SETTINGS:  # each in a fresh process: a peak RSS never goes down
        child = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
                 "--setting", setting]
        # large buffers from mmap, so that freed activations leave the resident set at once
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        proc = subprocess.run(child, capture_output=True, text=True, check=True, env=env)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    off, on = rows
    saved = off["step_peak_bytes"] - on["step_peak_bytes"]
    summary = {"model": args.model, "seq_len": args.seq_len, "batch": args.batch, "device": args.device,
               "saved_bytes": saved, "saved_fraction": saved / off["step_peak_bytes"],
               "time_ratio": on["step_s"] / off["step_s"]}
    mib = 2 ** 20
    print(f"{args.model}, batch {args.batch} x seq {args.seq_len}, {off['memory']}, step peak above the "
          f"weights: off {off['step_peak_bytes'] / mib:.0f} MiB, on {on['step_peak_bytes'] / mib:.0f} MiB, "
          f"saved {saved / mib:.0f} MiB ({summary['saved_fraction']:.0%}); step time on/off "
          f"{summary['time_ratio']:.2f}x ({on['step_s']:.2f} s / {off['step_s']:.2f} s)")
    if args.json:
        bc.write_json(args.json, bc.environment(torch.device(args.device)), rows, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
