"""Benchmark: the MLM loss, cross-entropy over the vocabulary (kernels/cross_entropy.py), against eager PyTorch.

    python benchmarks/bench_cross_entropy.py [--quick] [--json PATH]

The rows the MLM head predicts in one roberta-base step (15% of 32 x 512 tokens, 2458
rows) and all 16,384 rows (a head over every token, as Hugging Face's), vocabulary
50,265, bf16 logits on a GPU. Peer in the same run: eager
`F.cross_entropy(logits.float(), target)`, what autocast runs. Bandwidth counts the
bytes the op must move: the forward reads the logits, the backward reads them and
writes their grad; printed beside the measured device-to-device copy bandwidth.
--quick: tiny fp32 shapes, on the CPU under the Triton interpreter where there is no GPU.
"""
import torch
import torch.nn.functional as F

import _common as bc

bc.use_interpreter_without_gpu()
from roberta_fast.kernels import cross_entropy  # noqa: E402  (after the interpreter switch)


def main():
    args = bc.parser(__doc__.splitlines()[0]).parse_args()
    device = bc.default_device()
    quick = args.quick or device.type != "cuda"
    shapes, dtype = (((16, 300),), torch.float32) if quick else (((2458, 50265), (16384, 50265)), torch.bfloat16)
    copy = bc.copy_bandwidth_gbs(device)
    print(f"device: {bc.device_facts(device)['name']}  copy bandwidth: {copy:.1f} GB/s")

    results = []
    for rows, vocab in shapes:
        logits = torch.randn(rows, vocab, device=device, dtype=dtype, requires_grad=True)
        target = torch.randint(0, vocab, (rows,), device=device)
        dy = torch.ones((), device=device)
        times = {
            "fused": bc.fwd_bwd_ms(lambda x: cross_entropy(x, target, validate=False), (logits,), dy, device),
            "eager": bc.fwd_bwd_ms(lambda x: F.cross_entropy(x.float(), target), (logits,), dy, device),
        }
        size = logits.numel() * logits.element_size()
        nbytes = {"fwd": size, "bwd": 2 * size, "fwd+bwd": 3 * size}
        results += bc.bandwidth_rows({"rows": rows, "vocab": vocab, "dtype": str(dtype).removeprefix("torch.")},
                                     times, nbytes, copy)
    bc.print_rows(results, ["rows", "vocab", "dtype", "impl", "pass", "ms", "GB/s", "%copy", "x_vs_eager"])
    if args.json:
        bc.write_json(args.json, bc.environment(device), results, copy_bandwidth_gbs=round(copy, 1),
                      benchmark="cross_entropy")


if __name__ == "__main__":
    main()
