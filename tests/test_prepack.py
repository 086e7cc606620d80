"""rf.prepack: fp32 CPU inference on Linear weights packed once by oneDNN (roberta_fast/prepacked.py).

The same function as the plain model in fp32, so the tolerance is fp32 summation order: 1e-5.
Shapes: a padded batch holding a one-token row and a row as long as the model's positions allow
(test_quantize's tiny config and inputs).
"""
import copy
import os

import pytest
import torch
import torch.nn.functional as F

import roberta_fast as rf
from roberta_fast.prepacked import LAYER_LINEARS, PackedLinear, has_onednn_fp32
from test_quantize import (DROPIN, TINY, assert_a_partial_state_dict_loads_as_into_the_plain_model, assert_inference_only,
                           assert_the_packed_decoder_follows_the_tied_weights, awkward_inputs, model_of, outputs, padded,
                           resident_ratio)

pytestmark = pytest.mark.skipif(not has_onednn_fp32(), reason="needs a torch built with oneDNN (torch.backends.mkldnn)")


@pytest.mark.parametrize("cls", DROPIN)
def test_prepacked_outputs_equal_the_plain_models(cls):
    plain = model_of(cls)
    packed = rf.prepack(copy.deepcopy(plain))
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == len(LAYER_LINEARS) * TINY["num_hidden_layers"]
    if cls == "RobertaForMaskedLM":  # and the decoder, on a packed copy of the word embeddings
        assert isinstance(packed.lm_head.packed_decoder.layer, PackedLinear)
    ids, mask = awkward_inputs(cls)
    for got, want in zip(outputs(packed, ids, mask), outputs(plain, ids, mask), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(5, 13), (2, 3, 13), (1, 13), (0, 13), "transposed"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_computes_linear_and_its_gelu(shape, bias):
    """Odd sizes, a 3-D input, one row, no rows, a non-contiguous input; the GELU epilogue is
    F.gelu's erf form (the tanh form is 4.7e-4 away on these values, far outside 1e-6)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(13, 7, bias=bias)
    layer = PackedLinear(linear).eval()
    x = torch.randn(13, 4).t() if shape == "transposed" else torch.randn(*shape)
    with torch.no_grad():
        want = linear(x)
        got = layer(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.forward_gelu(x), F.gelu(got), rtol=0, atol=1e-6)
    assert torch.equal(layer.weight, linear.weight) and (not bias or torch.equal(layer.bias, linear.bias))


def test_a_packed_linears_weights_change_only_through_load_state_dict():
    """.weight and .bias are copies read back from the packed weight: an edit of one changes
    nothing, and assigning one is refused with the way that works (it was a KeyError, "attribute
    'weight' already exists", or a property without a setter)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(13, 7)
    layer = PackedLinear(linear).eval()
    x = torch.randn(5, 13)
    with torch.no_grad():
        want = linear(x)
        layer.weight.mul_(2)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    for name, value in [("weight", torch.nn.Parameter(linear.weight * 2)), ("weight", linear.weight * 2),
                        ("bias", torch.nn.Parameter(linear.bias * 2))]:
        with pytest.raises(AttributeError, match=rf"PackedLinear\.{name} is read back .* model\.load_state_dict"):
            setattr(layer, name, value)
    layer.load_state_dict({"weight": linear.weight * 2}, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, linear.weight * 2, linear.bias), rtol=1e-5, atol=1e-5)


def test_a_prepacked_model_exports_traces_and_compiles_to_its_outputs():
    """torch.export and jit.trace record F.linear on the weights as constants (no opaque oneDNN
    tensor in the graph); torch.compile runs the packed kernels outside its graph."""
    model = padded(rf.prepack(model_of("RobertaForSequenceClassification")))
    ids, mask = awkward_inputs("RobertaForSequenceClassification")
    with torch.inference_mode():
        want = model(ids, attention_mask=mask).logits
    program = torch.export.export(model, (ids,), {"attention_mask": mask}, strict=False)
    assert not [n for n in program.graph.nodes if "mkldnn" in str(n.target)]
    traced = torch.jit.trace(model, (ids, mask), strict=False)
    with torch.inference_mode():
        torch.testing.assert_close(program.module()(ids, attention_mask=mask).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(traced(ids, mask)[0], want, rtol=1e-5, atol=1e-5)
        compiled = torch.compile(model)(ids, attention_mask=mask).logits
    torch.testing.assert_close(compiled, want, rtol=1e-5, atol=1e-5)


def test_a_prepacked_model_saves_and_loads_as_the_plain_model(tmp_path):
    """Its state_dict is the plain model's, to the bit: save_pretrained writes a checkpoint that
    transformers and the plain class load; a plain state_dict loads into it; deepcopy repacks."""
    transformers = pytest.importorskip("transformers", reason="the interop check needs transformers")
    plain = model_of("RobertaForSequenceClassification")
    packed = rf.prepack(copy.deepcopy(plain))
    want_state = plain.state_dict()
    got_state = packed.state_dict()
    assert list(got_state) == list(want_state)
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    assert packed.num_parameters() == plain.num_parameters() and packed.num_parameters(only_trainable=True) == 0
    packed.save_pretrained(tmp_path)
    ids, mask = awkward_inputs("RobertaForSequenceClassification")
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits,
                                   rtol=1e-5, atol=1e-5)
    other = rf.prepack(model_of("RobertaForSequenceClassification", seed=1))
    other.load_state_dict(want_state)
    for model in (other, copy.deepcopy(packed)):
        for got, want in zip(outputs(model, ids, mask), outputs(packed, ids, mask), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    qkv = "roberta.encoder.layer.0.qkv.weight"
    bad = dict(want_state, **{qkv: want_state[qkv][:5]})
    with pytest.raises(RuntimeError, match=r"encoder\.layer\.0\.qkv\.weight: expected torch.float32 of shape"):
        other.load_state_dict(bad)


def test_a_partial_state_dict_loads_into_a_prepacked_model_as_into_the_plain_model():
    assert_a_partial_state_dict_loads_as_into_the_plain_model(rf.prepack)


def test_prepacked_and_quantized_layers_combine():
    """rf.quantize of a prepacked model is rf.quantize of the plain model (the packed weight reads
    back exactly), its MLM decoder included; rf.prepack of a quantized model leaves its int8 layers
    and decoder; both count parameters as the plain model does."""
    plain = model_of("RobertaForMaskedLM")
    ids, mask = awkward_inputs("RobertaForMaskedLM")
    direct = rf.quantize(copy.deepcopy(plain))
    via_prepack = rf.quantize(rf.prepack(copy.deepcopy(plain)))
    for got, want in zip(outputs(via_prepack, ids, mask), outputs(direct, ids, mask), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert rf.prepack(direct) is direct and not any(isinstance(m, PackedLinear) for m in direct.modules())
    assert type(direct.lm_head.packed_decoder.layer) is rf.quantization.Int8Linear
    assert direct.num_parameters() == plain.num_parameters()


def test_the_mlm_decoders_packed_copy_follows_the_tied_weights():
    assert_the_packed_decoder_follows_the_tied_weights(rf.prepack, PackedLinear)


def test_prepacked_models_refuse_training_gradients_and_other_dtypes():
    model = rf.prepack(model_of("RobertaForSequenceClassification"))
    ids, mask = awkward_inputs("RobertaForSequenceClassification")
    assert_inference_only(model, "prepacked", ids, mask)
    with pytest.raises(RuntimeError, match="take fp32 inputs on the CPU, got torch.bfloat16"):
        with torch.inference_mode():
            model.to(torch.bfloat16)(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="fp32 model on the CPU"):
        rf.prepack(model_of("RobertaModel").to(torch.bfloat16))
    with pytest.raises(ValueError, match="takes a roberta_fast model"):
        rf.prepack(torch.nn.Linear(4, 4))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc to read the resident memory")
def test_prepack_holds_the_weights_once():
    """The packed layers' resident memory is about the fp32 layers' (the packed copy replaces the
    original), not twice it."""
    ratio = resident_ratio("PackedLinear(linear)")
    assert 0.9 < ratio < 1.15, f"packed weights take {ratio:.3f} of fp32's memory"


@pytest.mark.parametrize("make", [rf.prepack, rf.quantize, lambda m: rf.quantize(m, dtype=torch.float16)],
                         ids=["prepack", "int8", "fp16-weights"])
def test_an_mlm_exported_right_after_a_load_or_a_resize_records_the_new_decoder(make):
    """An export cannot rebuild the decoder's packed copy as an eager call does: a load_state_dict rebuilds
    it at once (a post-hook), set_input_embeddings / resize_token_embeddings too; the fp32 copy is not
    exported at all (F.linear on the tied table: the table is recorded once)."""
    model = padded(make(model_of("RobertaForMaskedLM")))
    ids = torch.randint(3, TINY["vocab_size"], (2, 7))
    model.load_state_dict(make(model_of("RobertaForMaskedLM", seed=1)).state_dict())
    with torch.inference_mode():
        want = model(ids).logits
    model.load_state_dict(make(model_of("RobertaForMaskedLM", seed=2)).state_dict())  # what the export must record
    with torch.inference_mode():
        want2 = padded(make(model_of("RobertaForMaskedLM", seed=2)))(ids).logits
    assert (want2 - want).abs().max() > 0.1
    program = torch.export.export(model, (ids,), strict=False)
    torch.testing.assert_close(program.module()(ids).logits, want2, rtol=1e-5, atol=1e-5)
    if make is rf.prepack:  # the word embeddings' table once, as in the plain model's program
        sizes = [t.numel() for t in program.state_dict.values()] + [t.numel() for t in program.constants.values()
                                                                    if isinstance(t, torch.Tensor)]
        assert sizes.count(TINY["vocab_size"] * TINY["hidden_size"]) == 1
    model.resize_token_embeddings(TINY["vocab_size"] + 8)
    assert torch.export.export(model, (ids,), strict=False).module()(ids).logits.shape[-1] == TINY["vocab_size"] + 8
