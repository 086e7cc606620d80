"""Benchmark: one encoder Linear layer on the CPU, PyTorch's kernel libraries against ONNX Runtime's (MLAS).

    python benchmarks/bench_cpu_linear.py [--quick] [--json PATH] [--tokens 1,16,128,512,4096] [--repeats N]

Why: on single short requests ONNX Runtime leads rf, in fp32 and in int8 (docs/inference.md,
Latency). This times the layers alone, so that the end-to-end gap can be read against the
kernels': roberta-base's four Linear shapes (768→2304 the fused QKV, 768→768 the attention
output, 768→3072 and 3072→768 the FFN) at a few token counts. Contenders, on the same weights:
  fp32  torch             F.linear (aten::addmm: MKL's sgemm on the plain weight)
        rf-prepacked      rf.prepack's PackedLinear (oneDNN's brgemm on a weight packed once)
        onnxruntime       MatMul + Add in an onnxruntime CPU session (MLAS)
  int8  rf-int8           rf.quantize's Int8Linear, engine "onednn" (the default)
        rf-int8-fbgemm    the same, engine "fbgemm"
        onnxruntime-int8  that ONNX graph after quantize_dynamic's defaults (MLAS's u8s8 GEMM)
        onnxruntime-int8-7bit  the same with reduce_range=True (7-bit weights), what ONNX Runtime's
                          docs advise for u8s8 on AVX2 / AVX512 without VNNI, against saturation
ms per call: the median over --repeats interleaved rounds, each contender making one untimed
call then 5 timed ones per round (time_interleaved says why), on the threads torch uses
(onnxruntime: as many, no spinning). `vs_onnxruntime`: the ONNX Runtime contender of the
same precision's time over this one's (above 1: faster).
`max_rel_diff`: max |out - F.linear's fp32 out| over max |F.linear's out|, on the same input
(int8: its rounding, and on a CPU without VNNI any int16 saturation of u8·s8 pairs).
--quick (CI): a 64 → 96 layer at 1 and 16 tokens, 2 rounds.
"""
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import _common as bc

bc.use_interpreter_without_gpu()
from roberta_fast.prepacked import PackedLinear  # noqa: E402  (after the interpreter switch)
from roberta_fast.quantization import Int8Linear  # noqa: E402

SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))  # (in, out) of RobertaLayer's qkv, attn_out, ffn_in, ffn_out
PEER = {"torch": "onnxruntime", "rf-prepacked": "onnxruntime", "onnxruntime": "onnxruntime",
        "rf-int8": "onnxruntime-int8", "rf-int8-fbgemm": "onnxruntime-int8", "onnxruntime-int8": "onnxruntime-int8",
        "onnxruntime-int8-7bit": "onnxruntime-int8"}


def onnxruntime_layer(linear: nn.Linear, int8: bool, reduce_range: bool = False):
    """`linear` as ONNX MatMul + Add in an onnxruntime CPU session (all graph optimisations; after
    quantize_dynamic when `int8`, its defaults as bench_inference's onnxruntime-int8): a function
    of a torch tensor, or a string saying why it cannot run."""
    try:
        import onnx
        import onnxruntime  # noqa: F401  (bc.onnxruntime_cpu_session's)
        from onnx import TensorProto, helper, numpy_helper
        from onnxruntime.quantization import quantize_dynamic
    except ImportError:
        return "onnx / onnxruntime not installed (pip install -e .[export])"
    weight = numpy_helper.from_array(linear.weight.detach().t().contiguous().numpy(), "weight")  # (in, out)
    bias = numpy_helper.from_array(linear.bias.detach().numpy(), "bias")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "weight"], ["xw"]), helper.make_node("Add", ["xw", "bias"], ["y"])], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", linear.in_features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens", linear.out_features])], [weight, bias])
    with tempfile.TemporaryDirectory(prefix="bench_cpu_linear_") as tmp:  # the session holds the model once made
        path = os.path.join(tmp, "linear.onnx")
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
        if int8:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantize_dynamic(path, path.replace(".onnx", "-int8.onnx"), reduce_range=reduce_range)
            path = path.replace(".onnx", "-int8.onnx")
        session = bc.onnxruntime_cpu_session(path)
    return lambda x: torch.from_numpy(session.run(None, {"x": x.numpy()})[0])


def contenders(linear: nn.Linear):
    """name -> function of x (or why it cannot run), all on `linear`'s weights."""
    return {"torch": lambda x: F.linear(x, linear.weight, linear.bias),
            "rf-prepacked": PackedLinear(linear).eval(),
            "onnxruntime": onnxruntime_layer(linear, int8=False),
            "rf-int8": Int8Linear(linear, "onednn").eval(),
            "rf-int8-fbgemm": Int8Linear(linear, "fbgemm").eval(),
            "onnxruntime-int8": onnxruntime_layer(linear, int8=True),
            "onnxruntime-int8-7bit": onnxruntime_layer(linear, int8=True, reduce_range=True)}


def time_interleaved(runs: dict, x, repeats: int, burst: int = 5) -> dict:
    """name -> median ms of one call: in each of `repeats` rounds every contender makes one untimed
    call, then `burst` timed ones. The untimed call absorbs the previous contender's wake: PyTorch's
    OpenMP threads spin on the cores for a while after each op, which slowed the onnxruntime call
    that came right after a PyTorch one (measured: ~1.8x at 128 tokens when each was called once
    per round)."""
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            fn(x)
            for _ in range(burst):
                start = time.perf_counter()
                fn(x)
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    p = bc.parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,16,128,512,4096", help="comma-separated token counts per call")
    p.add_argument("--repeats", type=int, default=9, help="interleaved rounds of 5 timed calls each (median)")
    args = p.parse_args()
    shapes, tokens = ((64, 96),), [int(t) for t in args.tokens.split(",")]
    repeats = args.repeats
    if args.quick:
        tokens, repeats = [1, 16], 2
    else:
        shapes = SHAPES
    print(f"threads: {torch.get_num_threads()}")
    torch.manual_seed(0)
    results = []
    with torch.inference_mode():
        for in_features, out_features in shapes:
            linear = nn.Linear(in_features, out_features).eval().requires_grad_(False)
            built = contenders(linear)
            runs = {name: fn for name, fn in built.items() if callable(fn)}
            for count in tokens:
                x = torch.randn(count, in_features)
                expected = F.linear(x, linear.weight, linear.bias)
                ms = time_interleaved(runs, x, repeats)
                for name, fn in built.items():
                    row = {"in": in_features, "out": out_features, "tokens": count, "contender": name}
                    if name not in runs:
                        row["status"] = fn
                    else:
                        peer = ms.get(PEER[name])
                        error = (runs[name](x) - expected).abs().max() / expected.abs().max()
                        row.update(status="ok", ms=bc.sig(ms[name]), vs_onnxruntime=peer and bc.sig(peer / ms[name]),
                                   max_rel_diff=bc.sig(error.item()))
                    results.append(row)
                bc.print_rows(results[-len(built):],
                              ["in", "out", "tokens", "contender", "status", "ms", "vs_onnxruntime", "max_rel_diff"])
    if args.json:
        bc.write_json(args.json, bc.environment(torch.device("cpu")), results,
                      config={"threads": torch.get_num_threads(), "repeats": repeats, "tokens": tokens})


if __name__ == "__main__":
    main()
