"""Benchmark: bias + erf GELU (kernels/bias_gelu.py) against eager PyTorch.

    python benchmarks/bench_bias_gelu.py [--quick] [--json PATH]

Rows of 32 x 512 tokens, widths 768 and 1024 (as the issue asks) and the FFN widths
3072 and 4096 where the model uses it; bf16 on a GPU. Peer in the same run: eager
`F.gelu(x + bias)`. Bandwidth counts the bytes the op must move: forward reads x and
writes y, backward reads dy and x and writes dx; printed beside the measured
device-to-device copy bandwidth (target: >= 80% of it on an H100).
--quick: tiny fp32 shapes, on the CPU under the Triton interpreter where there is no GPU.
"""
import torch
import torch.nn.functional as F

import _common as bc

bc.use_interpreter_without_gpu()
from roberta_fast.kernels import bias_gelu  # noqa: E402  (after the interpreter switch)


def main():
    args = bc.parser(__doc__.splitlines()[0]).parse_args()
    device = bc.default_device()
    quick = args.quick or device.type != "cuda"
    rows, widths, dtype = (64, (32, 96), torch.float32) if quick else (32 * 512, (768, 1024, 3072, 4096), torch.bfloat16)
    copy = bc.copy_bandwidth_gbs(device)
    print(f"device: {bc.device_facts(device)['name']}  copy bandwidth: {copy:.1f} GB/s")

    results = []
    for n in widths:
        x = torch.randn(rows, n, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        times = {
            "fused": bc.fwd_bwd_ms(bias_gelu, (x, b), dy, device),
            "eager": bc.fwd_bwd_ms(lambda x, b: F.gelu(x + b), (x, b), dy, device),
        }
        size = x.numel() * x.element_size()
        nbytes = {"fwd": 2 * size, "bwd": 3 * size, "fwd+bwd": 5 * size}
        results += bc.bandwidth_rows({"rows": rows, "N": n, "dtype": str(dtype).removeprefix("torch.")},
                                     times, nbytes, copy)
    bc.print_rows(results, ["rows", "N", "dtype", "impl", "pass", "ms", "GB/s", "%copy", "x_vs_eager"])
    if args.json:
        bc.write_json(args.json, bc.environment(device), results, copy_bandwidth_gbs=round(copy, 1),
                      benchmark="bias_gelu")


if __name__ == "__main__":
    main()
