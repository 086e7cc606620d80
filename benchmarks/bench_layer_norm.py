"""Benchmark: residual + LayerNorm (kernels/layer_norm.py) against eager PyTorch.

    python benchmarks/bench_layer_norm.py [--quick] [--json PATH]

Rows of 32 x 512 tokens, hidden 768 and 1024 (RoBERTa base/large), on a GPU in three
cases: "plain" (x, residual and weights bf16, no dropout); "training", what the
model runs under bf16 autocast (x bf16, residual and weights fp32, output fp32, hidden
dropout 0.1 fused); and "training+copy", the same where the next matmul reads a bf16
copy of y (the model's case): the fused LayerNorm writes it in the same pass
(`cast_dtype`), "fused_then_cast" and eager cast it separately, as autocast would.
Peer in the same run: eager `F.layer_norm(F.dropout(x) + residual)` (+ `.to(bf16)`).
Bandwidth counts the bytes the op must move: forward reads x and residual and writes
y (and its copy), backward reads dy (and the copy's grad), x and residual and writes
dx and dresidual (one tensor when they are equal); it is printed beside the measured
device-to-device copy bandwidth (target: >= 80% of it on an H100).
--quick: tiny fp32 shapes, on the CPU under the Triton interpreter where there is no GPU.
"""
import torch
import torch.nn.functional as F

import _common as bc

bc.use_interpreter_without_gpu()
from roberta_fast.kernels import layer_norm  # noqa: E402  (after the interpreter switch)


def main():
    args = bc.parser(__doc__.splitlines()[0]).parse_args()
    device = bc.default_device()
    quick = args.quick or device.type != "cuda"
    rows, hiddens, dtype = (64, (32, 96), torch.float32) if quick else (32 * 512, (768, 1024), torch.bfloat16)
    copy = bc.copy_bandwidth_gbs(device)
    print(f"device: {bc.device_facts(device)['name']}  copy bandwidth: {copy:.1f} GB/s")

    results = []
    # (name, x dtype, residual/weights dtype, dropout p, does the next matmul read a copy in x's dtype)
    cases = [("plain", dtype, dtype, 0.0, False), ("training", dtype, torch.float32, 0.1, False),
             ("training+copy", dtype, torch.float32, 0.1, True)]
    for n in hiddens:
        for name, x_dtype, r_dtype, p, copy_y in cases:
            x = torch.randn(rows, n, device=device, dtype=x_dtype, requires_grad=True)
            r = torch.randn(rows, n, device=device, dtype=r_dtype, requires_grad=True)
            w = torch.randn(n, device=device, dtype=r_dtype, requires_grad=True)
            b = torch.randn(n, device=device, dtype=r_dtype, requires_grad=True)
            y_dtype = torch.promote_types(x_dtype, r_dtype)
            dy = torch.randn(rows, n, device=device, dtype=y_dtype)

            def fused(x, r, w, b, p=p):
                return layer_norm(x, w, b, 1e-5, residual=r, dropout_p=p)

            def eager(x, r, w, b, p=p, n=n):
                return F.layer_norm(F.dropout(x, p) + r, (n,), w, b, 1e-5)

            impls = {"fused": fused, "eager": eager}
            if copy_y:  # y and its copy in x's dtype, each with a grad
                cast = lambda fn: lambda *a: (lambda y: (y, y.to(x_dtype)))(fn(*a))
                impls = {"fused": lambda x, r, w, b, p=p: layer_norm(x, w, b, 1e-5, residual=r, dropout_p=p,
                                                                     cast_dtype=x_dtype),
                         "fused_then_cast": cast(fused), "eager": cast(eager)}
                dy = (dy, torch.randn(rows, n, device=device, dtype=x_dtype))
            times = {impl: bc.fwd_bwd_ms(fn, (x, r, w, b), dy, device) for impl, fn in impls.items()}
            x_size, r_size = x.numel() * x.element_size(), r.numel() * r.element_size()
            y_size = rows * n * y_dtype.itemsize + (x_size if copy_y else 0)  # y (+ its copy), and their grads
            # dresidual is a tensor of its own when dropout scales dx or the dtypes differ
            dr_size = r_size if (p > 0 or x_dtype != r_dtype) else 0
            fwd = x_size + r_size + y_size
            bwd = y_size + x_size + r_size + x_size + dr_size  # reads dy, x, residual; writes dx (+ dresidual)
            nbytes = {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}
            case = {"case": name, "rows": rows, "N": n, "x": str(x_dtype).removeprefix("torch."),
                    "residual": str(r_dtype).removeprefix("torch."), "dropout": p}
            results += bc.bandwidth_rows(case, times, nbytes, copy)
    bc.print_rows(results, ["case", "N", "x", "residual", "dropout", "impl", "pass", "ms", "GB/s", "%copy",
                               "x_vs_eager"])
    if args.json:
        bc.write_json(args.json, bc.environment(device), results, copy_bandwidth_gbs=round(copy, 1),
                      benchmark="layer_norm")


if __name__ == "__main__":
    main()
