"""rf.quantize: int8 inference, and fp16 weights, for every drop-in class (roberta_fast/quantization.py).

Tolerance, the flash-attention way (DESIGN.md): the int8 model's error against the fp32 model
must be at most 2x the error of PyTorch's own dynamic quantization
(torch.ao.quantization.quantize_dynamic of the same four Linear layers per block and of the MLM
decoder, per-tensor weights) plus 1e-3; and the eager int8 kernels must compute what their plain-aten description
(`int8_linear_ref`, what export traces) computes, to 1e-4. Shapes: a padded batch holding a
one-token row and a row as long as the model's positions allow (a tiny config: 62 tokens; the
tolerance tests also with roberta-base's positions, a 512-token row).
fp16 weights (dtype=torch.float16) must compute F.linear on the fp16-rounded weights: the model
equals the fp32 model with those weights rounded, to fp32 summation order (1e-5).
"""
import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import roberta_fast as rf
from roberta_fast.quantization import (LAYER_LINEARS, Fp16WeightLinear, Int8Linear, default_engine, int8_linear_ref,
                                       onnx_translation_table, sums_8bit_activations_exactly)

DROPIN = ["RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification", "RobertaForTokenClassification",
          "RobertaForQuestionAnswering", "RobertaForMultipleChoice"]
TINY = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=64, type_vocab_size=1)
LONGEST = TINY["max_position_embeddings"] - 2  # the model's limit (positions start at pad + 1)
LONGEST_BASE = 512  # roberta-base's limit (514 positions)


def model_of(cls, seed=0, longest=LONGEST):
    """A tiny `cls` whose positions allow rows of `longest` tokens."""
    torch.manual_seed(seed)
    return getattr(rf, cls)(rf.RobertaConfig(**{**TINY, "max_position_embeddings": longest + 2})).eval()


def awkward_inputs(cls, seed=0, longest=LONGEST):
    """Rows of `longest`, 1 and 5 real tokens, right-padded (multiple choice: 2 questions x 3 choices)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([longest, 1, 5, 9, longest, 2] if cls == "RobertaForMultipleChoice" else [longest, 1, 5])
    ids = torch.randint(3, TINY["vocab_size"], (len(lengths), longest), generator=g)
    mask = (torch.arange(longest)[None] < lengths[:, None]).long()
    ids[mask == 0] = 1
    if cls == "RobertaForMultipleChoice":
        ids, mask = ids.view(2, 3, longest), mask.view(2, 3, longest)
    return ids, mask


def outputs(model, ids, mask):
    """The class's outputs and every hidden state, flat."""
    with torch.inference_mode():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
    return [t for t in out.to_tuple() if isinstance(t, torch.Tensor)] + list(out.hidden_states)


class TorchDynamicDecoder(torch.nn.Module):
    """The MLM decoder (word embeddings, transposed, + lm_head.bias) as PyTorch's dynamic int8 Linear."""

    def __init__(self, model):
        super().__init__()
        linear = torch.nn.Linear(TINY["hidden_size"], TINY["vocab_size"])
        linear.weight.data, linear.bias.data = model.get_output_embeddings().weight.data, model.lm_head.bias.data
        self.linear = quantize_dynamic(torch.nn.Sequential(linear), {"0"})[0]

    def forward(self, x, weight, bias):
        return self.linear(x)


def quantize_dynamic(model, names):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        return torch.ao.quantization.quantize_dynamic(model, names, dtype=torch.qint8)


def torch_dynamic(model):
    """PyTorch's own dynamic quantization of the same layers: the four Linear layers per block and
    the MLM decoder."""
    names = {name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in LAYER_LINEARS}
    peer = quantize_dynamic(copy.deepcopy(model), names)
    if hasattr(peer, "lm_head"):
        peer.lm_head.packed_decoder = TorchDynamicDecoder(peer)
    return peer


@pytest.mark.parametrize("longest", [LONGEST, LONGEST_BASE])
@pytest.mark.parametrize("cls", DROPIN)
def test_int8_outputs_are_within_twice_pytorchs_dynamic_quantization_error(cls, longest):
    fp32 = model_of(cls, longest=longest)
    ids, mask = awkward_inputs(cls, longest=longest)
    want = outputs(fp32, ids, mask)
    peer = outputs(torch_dynamic(fp32), ids, mask)
    int8 = rf.quantize(copy.deepcopy(fp32))
    assert sum(isinstance(m, Int8Linear) for m in int8.modules()) == 4 * TINY["num_hidden_layers"]
    got = outputs(int8, ids, mask)
    assert len(got) == len(want) == len(peer)
    for g, w, p in zip(got, want, peer):
        err, peer_err = (g - w).abs().max().item(), (p - w).abs().max().item()
        assert err <= 2 * peer_err + 1e-3, (err, peer_err)
    assert (got[0] - want[0]).abs().max() > 0  # it did quantize (hidden_states[0], the embeddings, is not)
    # the unpadded path is kept: padded positions stay zero, as in the fp32 model
    hidden = got[-1].reshape(-1, longest, TINY["hidden_size"])
    assert hidden[mask.reshape(-1, longest) == 0].abs().max() == 0


class RoundedDecoder(torch.nn.Module):
    """The MLM decoder on the fp16-rounded word embeddings (the lookup keeps the fp32 table)."""

    def forward(self, x, weight, bias):
        return F.linear(x, weight.half().float(), bias)


def fp16_rounded(model):
    """A copy of the fp32 `model` whose encoder Linear weights, and MLM decoder, are rounded to fp16
    (and kept in fp32)."""
    rounded = copy.deepcopy(model)
    for name, module in rounded.named_modules():
        if name.rsplit(".", 1)[-1] in LAYER_LINEARS:
            module.weight.data = module.weight.data.half().float()
    if hasattr(rounded, "lm_head"):
        rounded.lm_head.packed_decoder = RoundedDecoder()
    return rounded


@pytest.mark.parametrize("longest", [LONGEST, LONGEST_BASE])
@pytest.mark.parametrize("cls", DROPIN)
def test_fp16_weight_models_compute_the_fp32_model_on_fp16_rounded_weights(cls, longest):
    fp32 = model_of(cls, longest=longest)
    ids, mask = awkward_inputs(cls, longest=longest)
    fp16 = rf.quantize(copy.deepcopy(fp32), dtype=torch.float16)
    assert sum(isinstance(m, Fp16WeightLinear) for m in fp16.modules()) == 4 * TINY["num_hidden_layers"]
    got, want, exact = outputs(fp16, ids, mask), outputs(fp16_rounded(fp32), ids, mask), outputs(fp32, ids, mask)
    assert len(got) == len(want) == len(exact)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert 0 < (got[-1] - exact[-1]).abs().max() < 1e-2  # it did round the weights, and no more than that
    hidden = got[-1].reshape(-1, longest, TINY["hidden_size"])  # the unpadded path is kept
    assert hidden[mask.reshape(-1, longest) == 0].abs().max() == 0


def test_the_fp16_weight_kernel_computes_linear_on_the_rounded_weights():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    with torch.no_grad():  # fp16's edges: subnormals, one below its smallest subnormal, its largest value
        linear.weight[0, :5] = torch.tensor([3e-6, 6e-8, 2.9e-8, 65504.0, -6.1e-5])
    q = Fp16WeightLinear(linear).eval()
    assert not list(q.buffers()) and not list(q.parameters())  # one copy of the weights: the packed one
    assert torch.equal(q.weight_fp16, linear.weight.detach().half()) and torch.equal(q.bias, linear.bias.detach())
    with torch.inference_mode():
        assert q(torch.empty(2, 0, 64)).shape == (2, 0, 96)  # no tokens, as nn.Linear
        for x in [torch.randn(3, 7, 64) * 4 + 1, torch.rand(1, 64), torch.randn(300, 64)]:
            out, want = q(x), F.linear(x, q.weight_fp16.float(), q.bias)
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
            torch.testing.assert_close(q.forward_gelu(x), F.gelu(out), rtol=0, atol=0)
    with torch.no_grad():
        linear.weight[1, 1] = 70000.0  # beyond fp16: refused, not saturated to 65504 without a word
    with pytest.raises(ValueError, match="beyond fp16's range"):
        Fp16WeightLinear(linear)


def has_engine(engine):
    """Whether this torch runs `engine` ("auto": fbgemm and oneDNN's int8 ops)."""
    if engine == "auto":
        return has_engine("fbgemm") and default_engine() == "onednn"
    return engine in torch.backends.quantized.supported_engines


def skip_unless_8bit(engine):
    if not sums_8bit_activations_exactly(engine):
        pytest.skip(f"8-bit activations need a CPU with VNNI or AMX, where {engine}'s u8*s8 products sum in int32")


@pytest.mark.parametrize("bits", [7, 8])
@pytest.mark.parametrize("engine", ["onednn", "fbgemm", "auto"])
def test_int8_kernels_compute_their_plain_aten_description(engine, bits):
    if not has_engine(engine):
        pytest.skip(f"this torch build has no {engine} quantized engine")
    if bits == 8:
        skip_unless_8bit(engine)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    q = Int8Linear(linear, engine, bits).eval()
    assert f"{bits}-bit activations" in repr(q) and q.activation_bits == bits
    assert not list(q.buffers()) and not list(q.parameters())  # one copy of the weights: the packed one
    scale = linear.weight.detach().abs().amax(dim=1) / 127
    torch.testing.assert_close(q.weight_int8.float() * q.weight_scale[:, None], linear.weight.detach(),
                               rtol=0, atol=scale.max().item() / 2 + 1e-7)  # round-to-nearest of the fp32 weights
    inputs = [torch.randn(3, 7, 64) * 4 + 1, torch.rand(1, 64), torch.randn(5, 64) - 3]  # mixed, >= 0, mostly < 0
    if engine != "fbgemm":  # rows over several threads' tasks of the C++ quantizer (fbgemm quantizes by its
        inputs.append(torch.randn(2, 8200, 64))  # own rounding, which puts ~1e-4 of such values one step apart)
    with torch.inference_mode():
        assert q(torch.empty(2, 0, 64)).shape == (2, 0, 96)  # no tokens, as nn.Linear
    for x in inputs:
        with torch.inference_mode():
            out, want = q(x), int8_linear_ref(x, q.weight_int8, q.weight_scale, q.bias, 2**bits - 1)
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
            # the FFN's layer: oneDNN's GELU epilogue is erf GELU (its tanh form is 5e-4 away on these outputs)
            torch.testing.assert_close(q.forward_gelu(x), F.gelu(out), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not has_engine("auto"), reason="needs torch's fbgemm engine and oneDNN's int8 ops")
def test_the_auto_engine_runs_short_calls_on_fbgemm_and_long_ones_on_onednn(monkeypatch):
    """engine="auto": bit for bit fbgemm's layer below AUTO_FBGEMM_BELOW_TOKENS tokens per call
    (whatever the batch shape), oneDNN's from there; its state is theirs."""
    from roberta_fast.quantization import AUTO_FBGEMM_BELOW_TOKENS as below
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    auto, fbgemm, onednn = (Int8Linear(linear, engine).eval() for engine in ("auto", "fbgemm", "onednn"))
    assert "engine=auto" in repr(auto) and not list(auto.buffers()) and not list(auto.parameters())
    assert all(torch.equal(a, b) for a, b in zip(auto.state_dict().values(), onednn.state_dict().values()))
    with torch.inference_mode():
        assert auto(torch.empty(2, 0, 64)).shape == (2, 0, 96)
        for shape, library in [((1, 64), fbgemm), ((below - 1, 64), fbgemm), ((3, (below - 1) // 3, 64), fbgemm),
                               ((below, 64), onednn), ((2, below // 2, 64), onednn), ((below + 7, 64), onednn)]:
            x = torch.randn(shape) * 3 + 0.5
            assert torch.equal(auto(x), library(x)) and torch.equal(auto.forward_gelu(x), library.forward_gelu(x))
            other = onednn if library is fbgemm else fbgemm  # the two differ: the test tells them apart
            assert not torch.equal(auto(x), other(x))
    # a whole model: every layer of a call on one library (the tiny model's calls are short: lower the switch)
    model = rf.quantize(model_of("RobertaModel"), engine="auto")
    ids, mask = awkward_inputs("RobertaModel")
    real = int(mask.sum())
    for switch, engine in [(real + 1, "fbgemm"), (real, "onednn")]:
        monkeypatch.setattr(rf.quantization, "AUTO_FBGEMM_BELOW_TOKENS", switch)
        single = rf.quantize(model_of("RobertaModel"), engine=engine)
        for g, w in zip(outputs(model, ids, mask), outputs(single, ids, mask)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_an_int8_model_quantizes_each_row_group_on_its_own():
    """A batch over cpu_group_tokens runs in groups of rows (RobertaModel.encode): each group's
    outputs are those of the group run alone, bit for bit, since its activations get their own scales."""
    model = rf.quantize(model_of("RobertaModel"))
    ids, mask = awkward_inputs("RobertaModel")  # rows of LONGEST, 1 and 5 real tokens
    model.cpu_group_tokens = None
    whole = outputs(model, ids, mask)
    model.cpu_group_tokens = LONGEST  # groups: the first row, then the other two
    grouped = outputs(model, ids, mask)
    alone = [outputs(model, ids[rows], mask[rows]) for rows in (slice(0, 1), slice(1, 3))]
    for g, first, rest in zip(grouped, *alone, strict=True):
        torch.testing.assert_close(g, torch.cat([first, rest]), rtol=0, atol=0)
    assert any(not torch.equal(g, w) for g, w in zip(grouped, whole))  # the grouping changed the scales


@pytest.mark.parametrize("qmax", [127, 255])
def test_the_eager_activation_quantization_equals_the_exported_one(qmax):
    """The oneDNN path quantizes its activations in C++ (csrc/quantize_activations.cpp); export
    does it with tensor ops (activation_qparams, int8_linear_ref). Same scale, zero point and
    uint8 values, bit for bit, on ranges of every kind (both signs, one sign, all zero, far below
    and above fbgemm's smallest scale), on exact rounding ties, and on inputs large enough to be
    split over threads with a tail the vector width does not divide."""
    from roberta_fast import _ext
    from roberta_fast.quantization import activation_qparams

    g = torch.Generator().manual_seed(0)
    cases = [torch.zeros(7), torch.full((3,), 1e-7), torch.full((3,), -2.5), torch.tensor([1e-3, -1e-8]),
             torch.arange(-254, 255) / 2.0, torch.arange(0, 255) / 2.0,  # exact .5 ties (scales 2 and 1)
             torch.randn(70_001, generator=g), torch.randn(3, 129, 768, generator=g).transpose(0, 1)]
    for i in range(300):
        x = torch.randn(int(torch.randint(1, 500, (), generator=g)), generator=g)
        x = x * 10 ** float(torch.empty(()).uniform_(-5, 3, generator=g)) + float(torch.randn((), generator=g))
        cases.append([x, x.abs(), -x.abs()][i % 3])
    for x in cases:
        scale, zero_point = activation_qparams(x, qmax)
        xq, host_scale, host_zero_point = _ext.load().quantize_activations(x, qmax)
        assert (host_scale, host_zero_point) == (scale.item(), zero_point.item()), x
        want = torch.clamp(torch.round(x * (1.0 / scale)) + zero_point, 0, 255).to(torch.uint8)  # int8_linear_ref's
        assert xq.shape == x.shape and torch.equal(xq, want)


@pytest.mark.parametrize("engine", ["onednn", "fbgemm"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_activation_is_refused(engine, bad):
    """No int8 scale covers inf or NaN: the layer says so instead of returning garbage (fbgemm
    alone turns a NaN into plausible finite outputs)."""
    if not has_engine(engine):
        pytest.skip(f"this torch build has no {engine} quantized engine")
    layer = Int8Linear(torch.nn.Linear(8, 4), engine).eval()
    x = torch.randn(3, 8)
    x[1, 2] = bad
    with torch.inference_mode(), pytest.raises(ValueError, match="non-finite activation"):
        layer(x)


def padded(model):
    """The padded path of the same model: what export traces (export never unpads)."""
    encoder = model.roberta if hasattr(model, "roberta") else model
    encoder.unpad = False
    return model


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
@pytest.mark.parametrize("cls", DROPIN)
def test_torch_export_of_a_quantized_model_equals_eager(cls, dtype):
    model = padded(rf.quantize(model_of(cls), dtype=dtype))
    ids, mask = awkward_inputs(cls)
    program = torch.export.export(model, (ids,), {"attention_mask": mask}, strict=False)
    with torch.inference_mode():
        got, want = program.module()(ids, attention_mask=mask).to_tuple(), model(ids, attention_mask=mask).to_tuple()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cls,dtype,int8_ops,bits", [("RobertaForSequenceClassification", torch.qint8, True, None),
                                                     ("RobertaForQuestionAnswering", torch.qint8, True, 7),
                                                     ("RobertaForMaskedLM", torch.qint8, True, None),
                                                     ("RobertaModel", torch.qint8, False, None),
                                                     ("RobertaForTokenClassification", torch.float16, False, None)])
def test_onnx_export_of_a_quantized_model_runs_in_onnxruntime_with_eagers_logits(cls, dtype, int8_ops, bits, tmp_path):
    """With onnx_translation_table() each int8 layer becomes ONNX's integer matmul (int8 speed in
    ONNX Runtime; 8-bit activations by DynamicQuantizeLinear, 7-bit ones by their own ops); without
    it, the same arithmetic in fp32 MatMuls. Either way: the eager logits. fp16 weights export as
    F.linear on their values, cast to fp32."""
    for package in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(package, reason=f"ONNX export needs {package}: pip install -e .[export]")
    import onnxruntime as ort

    model = padded(rf.quantize(model_of(cls), dtype=dtype, activation_bits=bits))
    ids, mask = awkward_inputs(cls)
    dims = {0: torch.export.Dim("batch", min=2, max=4096),  # the README's dims (min=2: torch < 2.10)
            1: torch.export.Dim("seqlen", min=2, max=model.config.max_seq_len)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.onnx's notes on its own internals
        program = torch.onnx.export(model, (ids,), kwargs={"attention_mask": mask}, dynamo=True, verbose=False,
                                    dynamic_shapes={"input_ids": dims, "attention_mask": dims},
                                    custom_translation_table=onnx_translation_table() if int8_ops else None)
    op_types = [node.op_type for node in program.model.graph]
    if int8_ops and rf.quantization.onnx_export_decomposes_custom_ops():  # torch 2.6: fp32 MatMuls, a warning
        with pytest.warns(UserWarning, match="pytorch#150367"):
            onnx_translation_table()
        int8_ops = False
    int8_layers = len(LAYER_LINEARS) * TINY["num_hidden_layers"] + (cls == "RobertaForMaskedLM")  # + its decoder
    assert op_types.count("MatMulInteger") == (int8_layers if int8_ops else 0), sorted(set(op_types))
    if int8_ops:
        eight = rf.quantization._quantized_as(model)[2] == 8
        assert op_types.count("DynamicQuantizeLinear") == (int8_layers if eight else 0), sorted(set(op_types))
    program.save(tmp_path / "int8.onnx")
    session = ort.InferenceSession(str(tmp_path / "int8.onnx"), providers=["CPUExecutionProvider"])
    ids, mask = ids[1:], mask[1:, :9]  # another shape than the traced one
    ids = ids[:, :9].contiguous()
    got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    with torch.inference_mode():
        want = model(ids, attention_mask=mask).to_tuple()[0]
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-4)


def resident_ratio(make_layer: str) -> float:
    """The resident memory of six roberta-base 768 -> 3072 layers after `make_layer` (an expression in
    `linear`, run in a child process with roberta_fast.prepacked and .quantization imported) replaced
    each nn.Linear, as a fraction of the six fp32 layers'."""
    child = textwrap.dedent(f"""
        import torch
        from roberta_fast.prepacked import PackedLinear
        from roberta_fast.quantization import Fp16WeightLinear, Int8Linear
        rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
        make = lambda linear: {make_layer}
        with torch.no_grad():  # load the kernels' code and caches first: they are not weights
            make(torch.nn.Linear(64, 64)).eval()(torch.randn(2, 64))
        start = rss()
        layers = [torch.nn.Linear(768, 3072) for _ in range(6)]
        fp32 = rss() - start
        packed = [make(layers.pop()) for _ in range(6)]
        print((rss() - start) / fp32)
    """)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # freed weights leave the RSS at once
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(default_engine() != "onednn" or not os.path.exists("/proc/self/statm"),
                    reason="needs torch's oneDNN int8 ops and Linux's /proc")
def test_the_onednn_engine_holds_the_int8_weights_once():
    """The int8 layers' resident memory is about a quarter of the fp32 layers' (one int8 copy, in
    oneDNN's layout), not a half (the original kept beside oneDNN's reordered copy)."""
    ratio = resident_ratio('Int8Linear(linear, "onednn")')
    assert 0.2 < ratio < 0.3, f"int8 weights take {ratio:.3f} of fp32's memory"


@pytest.mark.skipif(not has_engine("auto") or not os.path.exists("/proc/self/statm"),
                    reason="needs torch's fbgemm engine, oneDNN's int8 ops and Linux's /proc")
def test_the_auto_engine_holds_two_packings_and_no_more():
    """engine="auto": oneDNN's copy (0.25) and fbgemm's, whose AVX2 packing pads the inner dimension
    (0.33 here): about 0.6 of fp32's memory, not the original weights kept beside them."""
    ratio = resident_ratio('Int8Linear(linear, "auto")')
    assert 0.5 < ratio < 0.65, f"auto's two int8 packings take {ratio:.3f} of fp32's memory"


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_fp16_weights_are_held_once():
    """fbgemm's fp16 packing, the only copy: half fp32's bytes, padded (measured 0.67 here, as if
    the inner dimension went from 768 to 1024), not with fp32's copy kept beside it (1.5)."""
    ratio = resident_ratio("Fp16WeightLinear(linear)")
    assert 0.45 < ratio < 0.7, f"fp16 weights take {ratio:.3f} of fp32's memory"


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
def test_torch_compile_of_a_quantized_model_equals_eager(dtype):
    """The int8 kernels run outside the compiled graph (a graph break each: dynamo can fake neither
    packed weight), the rest compiled; the outputs are the eager model's."""
    model = rf.quantize(model_of("RobertaModel"), dtype=dtype)
    ids, mask = awkward_inputs("RobertaModel")
    with torch.inference_mode():
        want = model(ids, attention_mask=mask).last_hidden_state
        got = torch.compile(model)(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def assert_inference_only(model, kind, ids, mask):
    """A packed (`kind`: quantized, prepacked) classifier comes frozen, and refuses training mode, autocast
    and, unfrozen, a gradient; it is left in eval mode, unfrozen."""
    assert not any(p.requires_grad for p in model.parameters())
    model.train()
    with pytest.raises(RuntimeError, match=f"a {kind} model is for inference: call model.eval"):
        model(ids, attention_mask=mask)
    model.eval()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):  # not told to keep it fp32 on the CPU
        with pytest.raises(RuntimeError, match=f"a {kind} model computes in fp32 .*: call it outside torch.autocast"):
            model(ids, attention_mask=mask)
    model.requires_grad_(True)  # unfrozen: a gradient would be asked of the packed layers
    with pytest.raises(RuntimeError, match=f"{kind} Linear layers have no gradient"):
        model(ids, attention_mask=mask, labels=torch.tensor([0, 1, 0]))


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
def test_quantized_models_refuse_training_gradients_and_saving(tmp_path, dtype):
    model = rf.quantize(model_of("RobertaForSequenceClassification"), dtype=dtype)
    ids, mask = awkward_inputs("RobertaForSequenceClassification")
    assert_inference_only(model, "quantized", ids, mask)
    with pytest.raises(ValueError, match="cannot save_pretrained a quantized model"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    with pytest.raises(ValueError, match="fp32 model on the CPU"):
        rf.quantize(model_of("RobertaModel").to(torch.bfloat16))
    with pytest.raises(ValueError, match="takes a roberta_fast model"):
        rf.quantize(torch.nn.Linear(4, 4))
    assert rf.quantize(model, dtype=dtype) is model  # quantizing twice the same way changes nothing
    with pytest.raises(RuntimeError, match="take fp32 inputs on the CPU, got torch.bfloat16"):
        with torch.inference_mode():
            model.to(torch.bfloat16)(ids, attention_mask=mask)  # the int8 layers hold no tensor .to() could cast


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
def test_a_quantized_state_dict_is_not_saved_under_a_plain_models_names(tmp_path, dtype):
    """fp32_model.save_pretrained(d, state_dict=quantized.state_dict()) once wrote the int8 keys as they
    were and no Linear weights (transformers then loaded a random encoder): refused, nothing written."""
    fp32 = model_of("RobertaForSequenceClassification")
    state = rf.quantize(copy.deepcopy(fp32), dtype=dtype).state_dict()
    with pytest.raises(ValueError, match=r"quantized model's state_dict \(it holds "
                                         r"'roberta\.encoder\.layer\.0\.qkv\.weight_"
                                         r".*pass the fp32 model's state_dict"):
        fp32.save_pretrained(tmp_path / "out", state_dict=state)
    assert not (tmp_path / "out").exists()
    # any other key of an encoder layer has no HF name either: refused by name, not passed through
    state = {**fp32.state_dict(), "roberta.encoder.layer.1.ffn_in.weight_packed": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"'roberta\.encoder\.layer\.1\.ffn_in\.weight_packed' is not an encoder "
                                         r"layer's "
                                         r"weight or bias.*save the fp32 model's state_dict"):
        fp32.save_pretrained(tmp_path / "out", state_dict=state)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("engine", [None, "auto"])
def test_a_quantized_state_dict_loads_into_a_quantized_model(engine):
    if not has_engine(engine or default_engine()):
        pytest.skip(f"this torch build has no {engine} quantized engine")
    source, target = (rf.quantize(model_of("RobertaModel", seed=seed), engine=engine) for seed in (0, 1))
    target.load_state_dict(source.state_dict())
    twin = copy.deepcopy(source)
    ids, mask = awkward_inputs("RobertaModel")
    for g, t, w in zip(outputs(target, ids, mask), outputs(twin, ids, mask), outputs(source, ids, mask)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(t, w, rtol=0, atol=0)


def test_a_quantized_state_dict_is_checked_and_copies_deeply():
    model = rf.quantize(model_of("RobertaModel"), engine="fbgemm")
    state = model.state_dict()
    assert state["encoder.layer.0.qkv.weight_int8"].dtype == torch.int8
    bad = dict(state, **{"encoder.layer.0.qkv.weight_int8": state["encoder.layer.0.qkv.weight_int8"][:, :5]})
    with pytest.raises(RuntimeError, match=r"encoder\.layer\.0\.qkv\.weight_int8: expected torch.int8 of shape"):
        rf.quantize(model_of("RobertaModel")).load_state_dict(bad)
    del state["encoder.layer.1.ffn_out.bias"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"encoder\.layer\.1\.ffn_out\.bias\""):
        rf.quantize(model_of("RobertaModel")).load_state_dict(state)
    twin = copy.deepcopy(model)
    ids, mask = awkward_inputs("RobertaModel")
    for g, w in zip(outputs(twin, ids, mask), outputs(model, ids, mask)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
def test_a_quantized_layers_state_cannot_be_assigned(dtype):
    """Its state is read back from the packed weights: assigning it is refused with the way that
    works (it was a KeyError, "attribute 'bias' already exists", or a property without a setter)."""
    model = rf.quantize(model_of("RobertaModel"), dtype=dtype)
    layer = model.encoder.layer[0].qkv
    for name in layer.STATE:
        for value in (getattr(layer, name), torch.nn.Parameter(getattr(layer, name).float())):
            with pytest.raises(AttributeError, match=rf"\.{name} is read back .* model\.load_state_dict"):
                setattr(layer, name, value)


def assert_a_partial_state_dict_loads_as_into_the_plain_model(pack):
    """A partial state_dict (strict=False; here the biases alone, as BitFit trains them) loads into
    a `pack`ed model as into the fp32 model: what it gives changes, the rest stays, and the keys it
    lacks are reported missing (the packed layers once dropped the biases without a word)."""
    fp32 = model_of("RobertaForMaskedLM")
    model = pack(copy.deepcopy(fp32))
    biases = {key: value + 0.5 for key, value in fp32.state_dict().items() if key.endswith("bias")}
    assert "roberta.encoder.layer.0.qkv.bias" in biases and "lm_head.bias" in biases
    result = model.load_state_dict(biases, strict=False)
    assert set(result.missing_keys) == set(model.state_dict()) - set(biases) and not result.unexpected_keys
    fp32.load_state_dict(biases, strict=False)
    ids, mask = awkward_inputs("RobertaForMaskedLM")
    for got, want in zip(outputs(model, ids, mask), outputs(pack(copy.deepcopy(fp32)), ids, mask), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
def test_a_partial_state_dict_loads_into_a_quantized_model_as_into_the_plain_model(dtype):
    assert_a_partial_state_dict_loads_as_into_the_plain_model(lambda model: rf.quantize(model, dtype=dtype))


def assert_the_packed_decoder_follows_the_tied_weights(pack, layer_class):
    """`pack` (rf.quantize, rf.prepack) runs the MLM decoder on a `layer_class` copy of the word
    embeddings that is no state of its own: the state_dict and parameter count are the model's,
    and after the tied weights change (loaded, inference tensors too, edited in place, resized)
    the logits are those of the changed fp32 model packed afresh; after writes through `.data`,
    which no call can see, once `pack` is called again."""
    fp32 = model_of("RobertaForMaskedLM")
    ids, mask = awkward_inputs("RobertaForMaskedLM")
    model = pack(copy.deepcopy(fp32))
    assert type(model.lm_head.packed_decoder.layer) is layer_class
    assert not [key for key in model.state_dict() if "decoder" in key]
    assert model.num_parameters() == fp32.num_parameters()

    def assert_logits_of(changed_fp32, packed=model):
        want = outputs(pack(copy.deepcopy(changed_fp32)), ids, mask)[0]
        torch.testing.assert_close(outputs(packed, ids, mask)[0], want, rtol=0, atol=0)

    other = model_of("RobertaForMaskedLM", seed=1)
    model.load_state_dict(pack(copy.deepcopy(other)).state_dict())
    assert_logits_of(other)
    with torch.inference_mode():  # made here, its tensors keep no version counter: the load is seen all the same
        frozen = pack(model_of("RobertaForMaskedLM"))
        outputs(frozen, ids, mask)
        frozen.load_state_dict(pack(copy.deepcopy(other)).state_dict())
    assert_logits_of(other, frozen)
    with torch.no_grad():  # through transformers' view of the decoder: its weight is the embeddings'
        model.get_output_embeddings().weight.mul_(2)
        model.lm_head.bias.add_(1)
        other.get_output_embeddings().weight.mul_(2)
        other.lm_head.bias.add_(1)
    assert_logits_of(other)
    for m in (model, other):
        torch.manual_seed(2)  # resizing draws the new rows
        m.resize_token_embeddings(TINY["vocab_size"] + 7)
    assert_logits_of(other)
    for m in (model, other):  # transformers' idiom after resizing: unseen, until packed again
        m.get_input_embeddings().weight.data[5] = 3.0
        m.lm_head.bias.data.add_(1)
    assert pack(model) is model
    assert_logits_of(other)


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
def test_the_mlm_decoders_quantized_copy_follows_the_tied_weights(dtype):
    assert_the_packed_decoder_follows_the_tied_weights(lambda model: rf.quantize(model, dtype=dtype),
                                                       Fp16WeightLinear if dtype == torch.float16 else Int8Linear)


def test_quantize_refuses_arguments_it_cannot_honour():
    with pytest.raises(ValueError, match="quantized engines are"):
        rf.quantize(model_of("RobertaModel"), engine="no-such-engine")
    with pytest.raises(ValueError, match=r"pass torch.qint8 .* or torch.float16"):
        rf.quantize(model_of("RobertaModel"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp16 weights run on fbgemm's kernel"):
        rf.quantize(model_of("RobertaModel"), engine="onednn", dtype=torch.float16)
    int8 = rf.quantize(model_of("RobertaModel"), engine="fbgemm")
    assert rf.quantize(int8) is int8  # no engine asked: the one it has will do
    # never a silent mix, nor the wrong kind
    for engine, dtype in [("onednn", torch.qint8), ("auto", torch.qint8), (None, torch.float16)]:
        with pytest.raises(ValueError, match="already quantized .*quantize a fresh fp32 copy"):
            rf.quantize(int8, engine=engine, dtype=dtype)
    with pytest.raises(ValueError, match=r"already quantized \(engine='fbgemm', dtype=torch.float16, activation"):
        rf.quantize(rf.quantize(model_of("RobertaModel"), dtype=torch.float16))
    with torch.no_grad():
        fp32 = model_of("RobertaModel")
        fp32.encoder.layer[1].ffn_out.weight[0, 0] = 1e6
    with pytest.raises(ValueError, match="ffn_out of encoder block 1 has a weight of magnitude 1e.06, beyond fp16"):
        rf.quantize(fp32, dtype=torch.float16)
    assert not rf.quantization.is_quantized(fp32)  # refused before any layer was swapped
    with torch.no_grad():
        mlm = model_of("RobertaForMaskedLM")
        mlm.get_input_embeddings().weight[5, 0] = -1e6
    with pytest.raises(ValueError, match=r"the word embeddings \(the MLM decoder\) has a weight of magnitude 1e.06"):
        rf.quantize(mlm, dtype=torch.float16)
    assert not rf.quantization.is_quantized(mlm)
    for bits, message in [(6, "pass 8, 7, or None"), (16, "pass 8, 7, or None")]:
        with pytest.raises(ValueError, match=message):
            rf.quantize(model_of("RobertaModel"), activation_bits=bits)
    with pytest.raises(ValueError, match="fp16 weights keep fp32 activations"):
        rf.quantize(model_of("RobertaModel"), dtype=torch.float16, activation_bits=8)
    seven = rf.quantize(model_of("RobertaModel"), engine="fbgemm", activation_bits=7)
    assert rf.quantize(seven, activation_bits=7) is seven
    with pytest.raises(ValueError, match=r"activation_bits=7\); quantize a fresh fp32 copy"):
        rf.quantize(seven, activation_bits=8)


def test_8bit_activations_are_refused_where_the_kernels_would_saturate(monkeypatch):
    """Where the kernels add u8*s8 product pairs into int16 (no VNNI or AMX), 8-bit activations
    would saturate: the default is then 7 bits, 8 is refused, and so is a model with 8-bit
    activations unpickled there."""
    eight = None
    if sums_8bit_activations_exactly("fbgemm"):
        eight = copy.deepcopy(rf.quantize(model_of("RobertaModel"), engine="fbgemm", activation_bits=8))
    monkeypatch.setattr(rf.quantization, "sums_8bit_activations_exactly", lambda engine: False)
    assert {m.activation_bits for m in rf.quantize(model_of("RobertaModel")).modules()
            if isinstance(m, Int8Linear)} == {7}
    with pytest.raises(ValueError, match="8-bit int8 activations would saturate on this CPU's .*activation_bits=7"):
        rf.quantize(model_of("RobertaModel"), activation_bits=8)
    if eight is not None:
        with pytest.raises(ValueError, match="would saturate"):
            copy.deepcopy(eight)


@pytest.mark.skipif(not has_engine("qnnpack"), reason="this torch build has no qnnpack quantized engine")
def test_the_qnnpack_engine_runs_8bit_activations_on_every_cpu(monkeypatch):
    """qnnpack ignores reduce_range: a layer asked for 7 bits reported 7 and ran 8, so eager differed
    from its own export (int8_linear_ref at qmax 127). 7 is refused there, and the default is 8 even
    on a CPU without VNNI, where the other engines' default is 7; eager then computes its export's 8 bits."""
    with pytest.raises(ValueError, match="7-bit int8 activations on the qnnpack engine.*activation_bits=8 or None"):
        rf.quantize(model_of("RobertaModel"), engine="qnnpack", activation_bits=7)
    monkeypatch.setattr(rf.quantization, "has_int8_dot_products", lambda: False)  # a CPU without VNNI
    sums_8bit_activations_exactly.cache_clear()
    try:
        assert not sums_8bit_activations_exactly("fbgemm")
        model = rf.quantize(model_of("RobertaModel"), engine="qnnpack")
        assert {m.activation_bits for m in model.modules() if isinstance(m, Int8Linear)} == {8}
    finally:
        sums_8bit_activations_exactly.cache_clear()  # the real CPU's answers for the other tests
    torch.manual_seed(0)
    q = model.encoder.layer[0].ffn_in
    x = torch.randn(16, TINY["hidden_size"])
    with torch.inference_mode():
        torch.testing.assert_close(q(x), int8_linear_ref(x, q.weight_int8, q.weight_scale, q.bias, 255),
                                   rtol=1e-4, atol=1e-4)


def test_the_saturation_probe_sees_an_isa_without_vnni():
    """oneDNN capped to AVX2 (ONEDNN_MAX_CPU_ISA) adds u8*s8 pairs into int16 whatever the CPU: the
    probe must see it (measured here: 8-bit activations 9% off on that kernel), so the default is 7
    bits. On a VNNI CPU the uncapped kernels must sum 8 bits exactly at roberta-base's width."""
    if not has_engine("onednn"):
        pytest.skip("this torch build has no oneDNN quantized engine")
    child = textwrap.dedent("""
        import torch
        from roberta_fast.quantization import sums_8bit_activations_exactly
        print(sums_8bit_activations_exactly("onednn"))
    """)
    capped = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True,
                            env=dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")).stdout.split()[-1]
    assert capped == "False"
    for engine in ("onednn", "fbgemm"):
        if sums_8bit_activations_exactly(engine):  # the probe's answer holds on a wider layer and a batch
            q = Int8Linear(torch.nn.Linear(768, 64), engine, 8).eval()
            x = torch.full((40, 768), 255.0)
            x[:, ::5] = 0.0  # range [0, 255]: scale 1, activations 255 and 0
            with torch.inference_mode():
                want = x.double() @ (q.weight_int8.double() * q.weight_scale.double()[:, None]).t() + q.bias.double()
                torch.testing.assert_close(q(x).double(), want, rtol=1e-6, atol=1e-3)


def test_8bit_activations_halve_the_error():
    """Where the kernels sum 8-bit activations exactly, the default takes 8 bits: the int8 model's
    outputs land about twice as close to fp32's as with 7."""
    skip_unless_8bit(default_engine())
    fp32 = model_of("RobertaForSequenceClassification")
    ids, mask = awkward_inputs("RobertaForSequenceClassification")
    errors = {}
    for bits in (7, None):
        model = rf.quantize(copy.deepcopy(fp32), activation_bits=bits)
        errors[bits] = max((a - b).abs().mean().item() for a, b in zip(outputs(model, ids, mask),
                                                                     outputs(fp32, ids, mask)))
    assert {m.activation_bits for m in model.modules() if isinstance(m, Int8Linear)} == {8}
    assert errors[None] < 0.7 * errors[7], errors


def test_an_fp16_weight_state_dict_loads_into_an_fp16_weight_model_and_no_other():
    source = rf.quantize(model_of("RobertaModel"), dtype=torch.float16)
    state = source.state_dict()
    assert state["encoder.layer.0.qkv.weight_fp16"].dtype == torch.float16 and "encoder.layer.0.qkv.weight" not in state
    target = rf.quantize(model_of("RobertaModel", seed=1), dtype=torch.float16)
    target.load_state_dict(state)
    ids, mask = awkward_inputs("RobertaModel")
    for g, w in zip(outputs(target, ids, mask), outputs(source, ids, mask)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w in zip(outputs(copy.deepcopy(source), ids, mask), outputs(source, ids, mask)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"encoder\.layer\.0\.qkv\.weight_int8\""):
        rf.quantize(model_of("RobertaModel")).load_state_dict(state)  # int8 layers are not fp16 ones
    with pytest.raises(RuntimeError, match=r"encoder\.layer\.0\.qkv\.weight_fp16: expected torch.float16 of shape"):
        qkv = "encoder.layer.0.qkv.weight_fp16"
        target.load_state_dict(dict(state, **{qkv: state[qkv].float()}))


def test_fp16_weights_trace_combine_with_prepack_and_count_parameters():
    """jit.trace records F.linear on the fp16 weights (as torch.export does); rf.quantize(dtype=fp16)
    of a prepacked model is that of the plain model; num_parameters() counts the packed layers."""
    plain = model_of("RobertaModel")
    ids, mask = awkward_inputs("RobertaModel")
    direct = rf.quantize(copy.deepcopy(plain), dtype=torch.float16)
    via_prepack = rf.quantize(rf.prepack(copy.deepcopy(plain)), dtype=torch.float16)
    for got, want in zip(outputs(via_prepack, ids, mask), outputs(direct, ids, mask), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert direct.num_parameters() == plain.num_parameters()
    padded(direct)
    traced = torch.jit.trace(direct, (ids, mask), strict=False)
    with torch.inference_mode():
        torch.testing.assert_close(traced(ids, mask)[0], direct(ids, attention_mask=mask)[0], rtol=1e-5, atol=1e-5)


def _serve_in_child(models, x, queue):
    """A spawned process's work: each model's output on x (as numpy: by value, the process then exits)."""
    with torch.inference_mode():
        queue.put([model(x).last_hidden_state.numpy() for model in models])


def test_prepacked_int8_and_fp16_models_can_be_sent_to_a_spawned_process():
    """torch.multiprocessing (sentence-transformers' process pool, a DataLoader's workers) sends a model
    by sharing its tensors' file descriptors: the packed holders' state, unpacked for the pickle alone,
    was freed before the spawned process read it ("bad value(s) in fds_to_keep"). The child computes
    what the parent does, on every packing."""
    fp32 = rf.RobertaModel(rf.RobertaConfig(**TINY)).eval()
    models = [rf.prepack(copy.deepcopy(fp32)), rf.quantize(copy.deepcopy(fp32)),
              rf.quantize(copy.deepcopy(fp32), engine="fbgemm"), rf.quantize(copy.deepcopy(fp32), engine="auto"),
              rf.quantize(copy.deepcopy(fp32), dtype=torch.float16)]
    x = torch.randint(3, TINY["vocab_size"], (2, 9))
    context = torch.multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_serve_in_child, args=(models, x, queue))
    child.start()
    try:
        got = queue.get(timeout=300)
    finally:
        child.join(timeout=60)
    with torch.inference_mode():
        for model, out in zip(models, got, strict=True):
            torch.testing.assert_close(torch.from_numpy(out), model(x).last_hidden_state, rtol=0, atol=0)
