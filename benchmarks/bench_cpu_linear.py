"""Benchmark: one encoder Linear layer on the CPU, PyTorch's kernel libraries against ONNX Runtime's (MLAS).

    python benchmarks/bench_cpu_linear.py [--quick] [--json PATH] [--tokens 1,16,128,512,4096] [--repeats N]
                                         [--stack 12] [--stack-tokens 1,16,128]

Why: on single short requests ONNX Runtime leads rf, in fp32 and in int8 (docs/inference.md,
Latency). This times the layers alone, so that the end-to-end gap can be read against the
kernels': roberta-base's four Linear shapes (768→2304 the fused QKV, 768→768 the attention
output, 768→3072 and 3072→768 the FFN) at a few token counts; then the encoder's whole stack,
--stack blocks of those four layers chained in one call (`layers` 48 for roberta-base: 340 MB of
fp32 weights, read from memory at each call as in a forward, where one layer timed alone stays in
the cache; each block's QKV output is cut to its first 768 columns for the next layer).
Contenders, on the same weights:
  fp32  torch             F.linear (aten::addmm: MKL's sgemm on the plain weight)
        rf-prepacked      rf.prepack's PackedLinear (oneDNN's brgemm on a weight packed once)
        onnxruntime       MatMul + Add in an onnxruntime CPU session (MLAS)
  fp16 weights  rf-fp16-weights  rf.quantize(dtype=torch.float16)'s Fp16WeightLinear: fbgemm's
                          fp16-weight GEMM (torch.ops.quantized.linear_dynamic_fp16), weights
                          stored in fp16, fp32 activations and sums
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
--quick (CI): a 64 → 96 layer and a stack of 2 blocks at width 64 (FFN 96), at 1 and 16 tokens, 2 rounds.
"""
import os
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch
from torch import nn

import _common as bc

bc.use_interpreter_without_gpu()
from roberta_fast.prepacked import PackedLinear  # noqa: E402  (after the interpreter switch)
from roberta_fast.quantization import Fp16WeightLinear, Int8Linear  # noqa: E402

SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))  # (in, out) of RobertaLayer's qkv, attn_out, ffn_in, ffn_out
PEER = {"torch": "onnxruntime", "rf-prepacked": "onnxruntime", "onnxruntime": "onnxruntime",
        "rf-fp16-weights": "onnxruntime",
        "rf-int8": "onnxruntime-int8", "rf-int8-fbgemm": "onnxruntime-int8", "onnxruntime-int8": "onnxruntime-int8",
        "onnxruntime-int8-7bit": "onnxruntime-int8"}


def chain(layers, x):
    """The layers applied in turn, each input cut to the layer's width (the QKV output's first columns)."""
    for layer in layers:
        x = layer(x[:, :layer.in_features])
    return x


def onnxruntime_chain(linears: list, int8: bool, reduce_range: bool = False):
    """chain(linears) as ONNX MatMul + Add (and Slice) in an onnxruntime CPU session (all graph
    optimisations; after quantize_dynamic when `int8`, its defaults as bench_inference's
    onnxruntime-int8): a function of a torch tensor, or a string saying why it cannot run."""
    try:
        import onnx
        import onnxruntime  # noqa: F401  (bc.onnxruntime_cpu_session's)
        from onnx import TensorProto, helper, numpy_helper
        from onnxruntime.quantization import quantize_dynamic
    except ImportError:
        return "onnx / onnxruntime not installed (pip install -e .[export])"
    nodes, weights, current, width = [], [], "x", linears[0].in_features
    for i, linear in enumerate(linears):
        if linear.in_features != width:  # cut to the layer's width: columns [0, in_features)
            weights += [numpy_helper.from_array(np.array(v, dtype=np.int64), f"cut{i}_{k}")
                        for k, v in (("start", [0]), ("end", [linear.in_features]), ("axis", [1]))]
            cut = [current, f"cut{i}_start", f"cut{i}_end", f"cut{i}_axis"]
            nodes.append(helper.make_node("Slice", cut, [f"in{i}"]))
            current = f"in{i}"
        weights += [numpy_helper.from_array(linear.weight.detach().t().contiguous().numpy(), f"weight{i}"),  # (in, out)
                    numpy_helper.from_array(linear.bias.detach().numpy(), f"bias{i}")]
        out = "y" if i == len(linears) - 1 else f"out{i}"
        nodes += [helper.make_node("MatMul", [current, f"weight{i}"], [f"xw{i}"]),
                  helper.make_node("Add", [f"xw{i}", f"bias{i}"], [out])]
        current, width = out, linear.out_features
    graph = helper.make_graph(
        nodes, "linears", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", linears[0].in_features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens", width])], weights)
    with tempfile.TemporaryDirectory(prefix="bench_cpu_linear_") as tmp:  # the session holds the model once made
        path = os.path.join(tmp, "linears.onnx")
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
        if int8:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantize_dynamic(path, path.replace(".onnx", "-int8.onnx"), reduce_range=reduce_range)
            path = path.replace(".onnx", "-int8.onnx")
        session = bc.onnxruntime_cpu_session(path)
    return lambda x: torch.from_numpy(session.run(None, {"x": x.numpy()})[0])


def encoder_stack(blocks: int, hidden: int, ffn: int) -> list:
    """`blocks` encoder blocks' Linear layers in order: QKV, attention output, FFN in, FFN out."""
    shapes = [(hidden, 3 * hidden), (hidden, hidden), (hidden, ffn), (ffn, hidden)] * blocks
    return [nn.Linear(i, o).eval().requires_grad_(False) for i, o in shapes]


def contenders(linears: list):
    """name -> function of x (or why it cannot run): chain(linears) through each library, on the same weights."""
    def through(wrap):
        wrapped = [wrap(linear).eval() for linear in linears]
        return lambda x: chain(wrapped, x)

    return {"torch": lambda x: chain(linears, x),  # nn.Linear: F.linear
            "rf-prepacked": through(PackedLinear),
            "rf-fp16-weights": through(Fp16WeightLinear),
            "onnxruntime": onnxruntime_chain(linears, int8=False),
            "rf-int8": through(lambda linear: Int8Linear(linear, "onednn")),
            "rf-int8-fbgemm": through(lambda linear: Int8Linear(linear, "fbgemm")),
            "onnxruntime-int8": onnxruntime_chain(linears, int8=True),
            "onnxruntime-int8-7bit": onnxruntime_chain(linears, int8=True, reduce_range=True)}


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
    p.add_argument("--stack", type=int, default=12, help="encoder blocks in the chained stack (0: none)")
    p.add_argument("--stack-tokens", default="1,16,128", help="comma-separated token counts for the stack")
    args = p.parse_args()
    tokens, stack_tokens = ([int(t) for t in arg.split(",")] for arg in (args.tokens, args.stack_tokens))
    repeats, (hidden, ffn), blocks = args.repeats, (768, 3072), args.stack
    if args.quick:
        tokens = stack_tokens = [1, 16]
        repeats, (hidden, ffn), blocks = 2, (64, 96), min(blocks, 2)
    print(f"threads: {torch.get_num_threads()}")
    torch.manual_seed(0)
    cases = [([nn.Linear(i, o).eval().requires_grad_(False)], tokens)
             for i, o in (((64, 96),) if args.quick else SHAPES)]
    if blocks:
        cases.append((encoder_stack(blocks, hidden, ffn), stack_tokens))
    columns = ["layers", "in", "out", "tokens", "contender", "status", "ms", "vs_onnxruntime", "max_rel_diff"]
    results = []
    with torch.inference_mode():
        for linears, counts in cases:
            built = contenders(linears)
            runs = {name: fn for name, fn in built.items() if callable(fn)}
            for count in counts:
                x = torch.randn(count, linears[0].in_features)
                expected = chain(linears, x)
                ms = time_interleaved(runs, x, repeats)
                for name, fn in built.items():
                    row = {"layers": len(linears), "in": linears[0].in_features, "out": linears[-1].out_features,
                           "tokens": count, "contender": name}
                    if name not in runs:
                        row["status"] = fn
                    else:
                        peer = ms.get(PEER[name])
                        error = (runs[name](x) - expected).abs().max() / expected.abs().max()
                        row.update(status="ok", ms=bc.sig(ms[name]), vs_onnxruntime=peer and bc.sig(peer / ms[name]),
                                   max_rel_diff=bc.sig(error.item()))
                    results.append(row)
                bc.print_rows(results[-len(built):], columns)
            del built, runs  # the stack's copies (~1 GB for roberta-base) before the next case
    if args.json:
        bc.write_json(args.json, bc.environment(torch.device("cpu")), results,
                      config={"threads": torch.get_num_threads(), "repeats": repeats, "tokens": tokens,
                              "stack_blocks": blocks, "stack_tokens": stack_tokens, "stack_widths": [hidden, ffn]})


if __name__ == "__main__":
    main()
