"""Benchmark: roberta_fast's fused attention vs torch's scaled_dot_product_attention.

Times forward, backward and forward+backward at RoBERTa-base's shape (batch 32,
seqlen 512, 12 heads, head dim 64, bf16) for our kernel and for SDPA's flash,
cuDNN and memory-efficient backends (torch.nn.attention.sdpa_kernel), all in the
same run, and prints ms, TFLOP/s and our speed relative to the fastest SDPA.
FLOPs (non-causal, FlashAttention's convention): forward 4·B·H·S²·D, backward
2.5× the forward (the recomputation is not counted).

    python benchmarks/bench_attention.py [--json results/attention.json]
    python benchmarks/bench_attention.py --quick   # tiny shapes; on a CPU under Triton's interpreter

Measured on: no GPU was available when this was written; the GPU figures come
from running it on an H100 (see benchmarks/results/).
"""
import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402

from roberta_fast.kernels.attention import attention  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--headdim", type=int, default=64, choices=(32, 64, 128))
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--dropout", type=float, default=0.0, help="attention-probability dropout for every contender")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repeats (CPU / interpreter smoke run)")
    p.add_argument("--json", help="write the results to this JSON file")
    args = p.parse_args()
    if args.quick:
        args.batch, args.seqlen, args.heads, args.headdim = 2, 64, 2, 32
        if not torch.cuda.is_available():
            args.dtype = "fp32"  # the interpreter computes bf16 dots wrongly and fp16 matmul on CPU is slow
    return args


def timer(fn, quick):
    """Median milliseconds of fn(): triton's do_bench (L2 flushed between runs) on a GPU, wall clock on a CPU."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 200)
    fn()  # warm up (compiles / traces)
    times = []
    for _ in range(2 if quick else 5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def contenders(dropout):
    """name -> (q, k, v) -> out in (batch, seqlen, nheads, headdim) layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def sdpa_with(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):  # SDPA wants (B, H, S, D): transposed views, as HF's attention makes
                return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout).transpose(1, 2)
        return run

    return {
        "roberta_fast": lambda q, k, v: attention(q, k, v, dropout_p=dropout),
        "sdpa_flash": sdpa_with(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION),
        "sdpa_efficient": sdpa_with(SDPBackend.EFFICIENT_ATTENTION),
    }


def measure(fn, q, k, v, quick):
    """(fwd_ms, bwd_ms, fwd_bwd_ms) of fn; backward alone = fwd+bwd minus fwd."""
    dout = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def fwd_bwd():
        torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    fwd_ms = timer(fwd, quick)
    total_ms = timer(fwd_bwd, quick)
    return fwd_ms, total_ms - fwd_ms, total_ms


def write_json(path, payload):
    """Write atomically: a temp file in the same folder, then rename."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def main():
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype]
    b, s, h, d = args.batch, args.seqlen, args.heads, args.headdim
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    fwd_flop = 4 * b * h * s * s * d
    flops = {"fwd": fwd_flop, "bwd": 2.5 * fwd_flop, "fwd_bwd": 3.5 * fwd_flop}

    device_name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or 'unknown'})"
    print(f"attention fwd/bwd  batch {b} seqlen {s} heads {h} headdim {d} {args.dtype} dropout {args.dropout} "
          f"on {device_name}{' (Triton interpreter)' if os.environ.get('TRITON_INTERPRET') == '1' else ''}")
    print(f"{'contender':16s} {'fwd ms':>9s} {'bwd ms':>9s} {'f+b ms':>9s} {'fwd TF/s':>9s} {'bwd TF/s':>9s} "
          f"{'f+b TF/s':>9s}")
    results = {}
    for name, fn in contenders(args.dropout).items():
        try:
            times = measure(fn, q, k, v, args.quick)
        except (RuntimeError, NotImplementedError) as err:  # backend not available on this device / dtype
            results[name] = {"unavailable": str(err).split("\n")[0][:200]}
            print(f"{name:16s} unavailable: {results[name]['unavailable']}")
            continue
        row = {}
        for phase, ms in zip(("fwd", "bwd", "fwd_bwd"), times):
            row[f"{phase}_ms"] = ms
            row[f"{phase}_tflops"] = flops[phase] / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")
        results[name] = row
        print(f"{name:16s} {row['fwd_ms']:9.3f} {row['bwd_ms']:9.3f} {row['fwd_bwd_ms']:9.3f} "
              f"{row['fwd_tflops']:9.3g} {row['bwd_tflops']:9.3g} {row['fwd_bwd_tflops']:9.3g}")

    sdpa = {n: r["fwd_bwd_ms"] for n, r in results.items() if n.startswith("sdpa") and "fwd_bwd_ms" in r}
    summary = {}
    if sdpa and "fwd_bwd_ms" in results["roberta_fast"]:
        best = min(sdpa, key=sdpa.get)
        summary = {"best_sdpa": best, "speedup_vs_best_sdpa": sdpa[best] / results["roberta_fast"]["fwd_bwd_ms"]}
        print(f"roberta_fast fwd+bwd speed vs best SDPA ({best}): {summary['speedup_vs_best_sdpa']:.3f}x")
    if args.json:
        write_json(args.json, {
            "benchmark": "attention", "device": device_name, "torch": torch.__version__,
            "triton": triton.__version__, "python": sys.version.split()[0],
            "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
            "shape": {"batch": b, "seqlen": s, "heads": h, "headdim": d}, "dtype": args.dtype,
            "dropout": args.dropout, "flop": flops, "results": results, **summary,
        })
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
