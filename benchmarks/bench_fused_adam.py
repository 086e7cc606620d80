"""FusedAdam against torch.optim.AdamW (fused=True, foreach=True) on roberta-base's
parameter set (124.7M fp32 parameters in 202 tensors, MLM head tied).

Reported per contender: ms per optimizer step, the bandwidth of the bytes an AdamW
step must move (fp32: param r+w, grad r, exp_avg r+w, exp_avg_sq r+w = 28 B per
parameter; +4 B for the overflow check of a mixed-precision step), its fraction of
the copy bandwidth measured in the same run, and the speed-up over torch's fused
AdamW. Targets (issue 4): >= 1.0x torch fused, >= 85% of copy bandwidth.

    python benchmarks/bench_fused_adam.py            # GPU: roberta-base, recorded in results/
    python benchmarks/bench_fused_adam.py --quick    # any machine, a tiny parameter set
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as bc  # noqa: E402

import roberta_fast as rf  # noqa: E402

HYPER = dict(lr=6e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)


def roberta_shapes(vocab=50265, hidden=768, layers=12, ffn=3072, positions=514):
    """Parameter shapes of RobertaForMaskedLM (decoder weight tied to the embeddings)."""
    shapes = [(vocab, hidden), (positions, hidden), (1, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (hidden,)] * 4 + [(hidden,), (hidden,)]
        shapes += [(ffn, hidden), (ffn,), (hidden, ffn), (hidden,), (hidden,), (hidden,)]
    shapes += [(hidden, hidden), (hidden,), (hidden,), (hidden,), (vocab,)]
    return shapes


def make_params(shapes, device):
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=g) * 1e-3
    return params


def contenders(shapes, device):
    """name -> (step function, bytes moved per step)."""
    n = sum(torch.Size(s).numel() for s in shapes)
    out = {}

    p = make_params(shapes, device)
    opt = rf.FusedAdam(p, **HYPER)
    out["rf-fused"] = (lambda: opt.step(), 28 * n)

    p2 = make_params(shapes, device)
    opt2 = rf.FusedAdam(p2, **HYPER)
    scale = torch.tensor(1.0, device=device)
    out["rf-fused-amp"] = (lambda: opt2.step(grad_scale=scale), 32 * n)

    for name, kw in (("torch-fused", dict(fused=True)), ("torch-foreach", dict(foreach=True))):
        q = make_params(shapes, device)
        try:
            o = torch.optim.AdamW(q, **HYPER, **kw)
            o.step()
        except (RuntimeError, ValueError) as err:
            print(f"{name}: skipped ({err})")
            continue
        out[name] = (o.step, 28 * n)

    # torch's mixed-precision step as GradScaler runs it with a fused optimizer:
    # an inf check pass over the gradients, then the fused step reading found_inf.
    q = make_params(shapes, device)
    try:
        o = torch.optim.AdamW(q, **HYPER, fused=True)
        grads = [x.grad for x in q]
        found_inf = torch.zeros((), device=device)  # shapes as GradScaler makes them
        one = torch.ones((), device=device)

        def amp_step():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)
            o.grad_scale, o.found_inf = one, found_inf
            o.step()

        amp_step()
        out["torch-fused-amp"] = (amp_step, 32 * n)
    except (RuntimeError, ValueError, AttributeError) as err:
        print(f"torch-fused-amp: skipped ({err})")
    return n, out


def main():
    args = bc.parser(__doc__.splitlines()[0]).parse_args()
    device = bc.default_device()
    shapes = roberta_shapes(1000, 64, 2, 256, 66) if args.quick else roberta_shapes()
    n, runs = contenders(shapes, device)
    copy = bc.copy_bandwidth_gbs(device)
    times = {name: bc.bench_ms(fn, device) for name, (fn, _) in runs.items()}
    peer = times.get("torch-fused")
    rows = []
    for name, ms in times.items():
        gbs = runs[name][1] / ms / 1e6
        row = {"impl": name, "params": n, "tensors": len(shapes), "ms": bc.sig(ms),
               "GB/s": bc.sig(gbs), "%copy": bc.sig(100 * gbs / copy),
               "x_vs_torch_fused": bc.sig(peer / ms) if peer else None}
        if name == "rf-fused-amp" and "torch-fused-amp" in times:
            row["x_vs_torch_fused"] = bc.sig(times["torch-fused-amp"] / ms)  # like for like
        rows.append(row)
    print(f"copy bandwidth {bc.sig(copy)} GB/s on {bc.device_facts(device)['name']}")
    bc.print_rows(rows, ["impl", "params", "tensors", "ms", "GB/s", "%copy", "x_vs_torch_fused"])
    targets = {"x_vs_torch_fused": 1.0, "%copy": 85.0}
    path = bc.record_path(args, "fused_adam", device)
    if path:
        bc.write_json(path, bc.environment(device), rows, copy_gbs=bc.sig(copy), targets=targets)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
