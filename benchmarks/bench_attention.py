"""Benchmark: roberta_fast's fused attention (kernels/attention.py) vs torch's SDPA.

    python benchmarks/bench_attention.py [--quick] [--json PATH] [--dropout 0.1] [--dtype fp16]

RoBERTa-base's attention: batch 32, seqlen 512, 12 heads, head dim 64, bf16 on a GPU.
Peers in the same run: `scaled_dot_product_attention` with the flash, cuDNN and
memory-efficient backends (torch.nn.attention.sdpa_kernel), given the transposed
(B, H, S, D) views HF's attention makes. `roberta_fast_qkvpacked` is the same kernel as
the model calls it: on the fused projection's (B, S, 3, H, D) output, returning one
dQKV (`roberta_fast` takes and returns three tensors). Passes: forward, backward alone (on a kept
graph) and forward+backward. FLOPs (non-causal, FlashAttention's convention):
forward 4·B·H·S²·D, backward 2.5× that (its recomputation is not counted).
Target: fwd+bwd >= 1.0x the fastest SDPA backend on an H100.
--quick: tiny fp32 shapes, on the CPU under the Triton interpreter where there is no
GPU (the figures then only prove the script runs).
Measured on: not yet on a GPU (written on a CPU-only machine); see benchmarks/results/.
"""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import _common as bc

bc.use_interpreter_without_gpu()
from roberta_fast.kernels import attention, attention_qkvpacked  # noqa: E402  (after the interpreter switch)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa(backend, dropout_p):
    """SDPA pinned to one backend, on (B, S, H, D) tensors like ours."""
    def run(q, k, v):
        with sdpa_kernel(backend):
            out = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               dropout_p=dropout_p)  # (B, H, S, D)
        return out.transpose(1, 2)
    return run


def main():
    p = bc.parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--headdim", type=int, default=64, choices=(32, 64, 128))
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout for every contender")
    args = p.parse_args()
    device = bc.default_device()
    quick = args.quick or device.type != "cuda"
    b, s, h, d = (2, 64, 2, 32) if quick else (args.batch, args.seqlen, args.heads, args.headdim)
    dtype = torch.float32 if device.type != "cuda" else DTYPES[args.dtype]  # interpreter: bf16 dots are wrong
    print(f"device: {bc.device_facts(device)['name']}  batch {b} seqlen {s} heads {h} headdim {d} "
          f"{dtype} dropout {args.dropout}")

    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    qkv = torch.randn(b, s, 3, h, d, device=device, dtype=dtype, requires_grad=True)  # the model's layout
    dout = torch.randn_like(q)
    # (inputs, fn): the peers take three tensors, as HF's separate projections make them;
    # roberta_fast_qkvpacked takes the fused projection's output and returns one dQKV, as the model runs it
    contenders = {"roberta_fast": ((q, k, v), lambda q, k, v: attention(q, k, v, dropout_p=args.dropout)),
                  "roberta_fast_qkvpacked": ((qkv,), lambda qkv: attention_qkvpacked(qkv, dropout_p=args.dropout))}
    contenders.update({name: ((q, k, v), sdpa(backend, args.dropout)) for name, backend in SDPA_BACKENDS.items()})
    times, skipped = {}, {}
    for name, (inputs, fn) in contenders.items():
        try:
            times[name] = bc.fwd_bwd_ms(fn, inputs, dout, device)
        except RuntimeError as err:  # this SDPA backend does not run on this device / dtype / shape
            skipped[name] = str(err).splitlines()[0][:160]
            print(f"{name}: skipped ({skipped[name]})")

    fwd_flop = 4 * b * h * s * s * d
    flop = {"fwd": fwd_flop, "bwd": 2.5 * fwd_flop, "fwd+bwd": 3.5 * fwd_flop}
    sdpa_ran = [n for n in times if n in SDPA_BACKENDS]
    best = {name: min(times[n][name] for n in sdpa_ran) for name in flop} if sdpa_ran else None
    rows = []
    for impl, by_pass in times.items():
        for name, ms in by_pass.items():
            row = {"B": b, "S": s, "H": h, "D": d, "dtype": str(dtype).removeprefix("torch."), "impl": impl,
                   "pass": name, "ms": bc._sig(ms), "TFLOP/s": bc._sig(flop[name] / ms / 1e9)}
            if best:
                row["x_vs_best_sdpa"] = bc._sig(best[name] / ms)
            rows.append(row)
    bc.print_rows(rows, ["B", "S", "H", "D", "dtype", "impl", "pass", "ms", "TFLOP/s", "x_vs_best_sdpa"])
    if args.json:
        bc.write_json(args.json, bc.environment(device), rows, benchmark="attention", dropout=args.dropout,
                      skipped=skipped, flop=flop)


if __name__ == "__main__":
    main()
