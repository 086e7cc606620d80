"""Benchmark: residual + LayerNorm (kernels/layer_norm.py) against eager PyTorch.

    python benchmarks/bench_layer_norm.py [--quick] [--json PATH]

Rows of 32 x 512 tokens, hidden 768 and 1024 (RoBERTa base/large), bf16 on a GPU.
Peer in the same run: eager `F.layer_norm(x + residual)`. Bandwidth counts the bytes
the op must move: forward reads x and residual and writes y, backward reads dy, x
and residual and writes dx (= dresidual); it is printed beside the measured
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
    for n in hiddens:
        x = torch.randn(rows, n, device=device, dtype=dtype, requires_grad=True)
        r = torch.randn_like(x, requires_grad=True)
        w = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        times = {
            "fused": bc.fwd_bwd_ms(lambda x, r, w, b: layer_norm(x, w, b, 1e-5, residual=r), (x, r, w, b), dy, device),
            "eager": bc.fwd_bwd_ms(lambda x, r, w, b: F.layer_norm(x + r, (n,), w, b, 1e-5), (x, r, w, b), dy, device),
        }
        size = x.numel() * x.element_size()
        nbytes = {"fwd": 3 * size, "bwd": 4 * size, "fwd+bwd": 7 * size}
        results += bc.bandwidth_rows({"rows": rows, "N": n, "dtype": str(dtype).removeprefix("torch.")},
                                     times, nbytes, copy)
    bc.print_rows(results, ["rows", "N", "dtype", "impl", "pass", "ms", "GB/s", "%copy", "x_vs_eager"])
    if args.json:
        bc.write_json(args.json, bc.environment(device), results, copy_bandwidth_gbs=round(copy, 1),
                      benchmark="layer_norm")


if __name__ == "__main__":
    main()
