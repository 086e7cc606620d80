"""The C++ CPU inference layer (csrc/inference_layer.cpp) against its reference, RobertaLayer's Python
path (`cpu_inference_layer = False`): the same ops on the same tensors, so every output and hidden
state must be equal bit for bit, for plain nn.Linear layers and every packed kernel (rf.quantize's
int8 on oneDNN and fbgemm, its fp16 weights, rf.prepack's fp32) on awkward inputs: padded rows of
62, 1 and 5 tokens (unpadded: per-sequence attention), the same batch padded (a dense key mask),
packed segments (cu_seqlens), one unmasked row and a one-token request; every drop-in class also with
a 512-token row (roberta-base's longest). And where the C++ layer
cannot do what the Python path does (hooks, attention probabilities, gradients, training, export,
an extension built without the op), the Python path must run instead.
"""
import threading
import time
import types

import pytest
import torch

import roberta_fast as rf
import roberta_fast.model as model_module
from roberta_fast.model import RobertaLayer

from test_quantize import DROPIN, LONGEST, LONGEST_BASE, TINY, awkward_inputs, has_engine, model_of

PACKINGS = {
    "plain": lambda m: m,  # nn.Linear layers: F.linear
    "int8-onednn": lambda m: rf.quantize(m, engine="onednn"),
    "int8-fbgemm": lambda m: rf.quantize(m, engine="fbgemm"),
    "fp16": lambda m: rf.quantize(m, dtype=torch.float16),
    "prepack": rf.prepack,
}


def count_layer_calls(monkeypatch, counted: list, unpadded_only: bool = False) -> list:
    """Append to `counted` at each layer call that runs as the C++ op (model.py's _ext, wrapped);
    unpadded_only: only the calls given cu_seqlens (the per-sequence attention)."""
    layer = model_module._ext.optional("inference_layer")

    def inference_layer(*args):
        if not unpadded_only or args[-1] is not None:  # args[-1]: cu_seqlens
            counted.append(1)
        return layer(*args)

    monkeypatch.setattr(model_module, "_ext", types.SimpleNamespace(optional=lambda name: inference_layer))
    return counted


@pytest.fixture
def calls(monkeypatch):
    """How many layer calls ran as the C++ op."""
    return count_layer_calls(monkeypatch, [])


def both_paths(model, *args, **kwargs):
    """(C++ layer's outputs, Python path's outputs), each the flat tensors of the output and every
    hidden state, under inference_mode."""
    results = []
    layers = [layer for layer in model.modules() if isinstance(layer, RobertaLayer)]
    for fused in (True, False):
        for layer in layers:
            layer.cpu_inference_layer = fused
        with torch.inference_mode():
            out = model(*args, output_hidden_states=True, **kwargs)
        results.append([t for t in out.to_tuple() if isinstance(t, torch.Tensor)] + list(out.hidden_states))
    for layer in layers:
        del layer.cpu_inference_layer  # the class's default again
    return results


def skip_without(packing):
    engine = packing.partition("-")[2]
    if engine and not has_engine(engine):
        pytest.skip(f"this torch build has no {engine} quantized engine")


def assert_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w), (g - w).abs().max()


@pytest.mark.parametrize("packing", PACKINGS)
def test_the_cpp_layer_equals_the_python_path_bit_for_bit(packing, calls):
    skip_without(packing)
    model = PACKINGS[packing](model_of("RobertaModel"))
    layers = TINY["num_hidden_layers"]
    ids, mask = awkward_inputs("RobertaModel")
    # unpadded (per-sequence attention), then the same batch padded (a dense key mask)
    for unpad in (True, False):
        model.unpad = unpad
        calls.clear()
        got, want = both_paths(model, ids, attention_mask=mask)
        assert len(calls) == layers  # the first pass ran every layer in C++, the reference none
        assert_equal(got, want)
    model.unpad = True
    bounds = [0, 7, 8, 30, 62, 124, 150, 186]  # packed rows of 62: segments end at every row's end
    segments = torch.tensor(bounds, dtype=torch.int32)
    positions = torch.cat([torch.arange(e - s) + 2 for s, e in zip(bounds, bounds[1:])]).view(ids.shape)
    cases = [((ids,), {"cu_seqlens": segments, "position_ids": positions}),  # packed segments
             ((ids[:1],), {}),  # one unmasked row
             ((ids[1:2, :1],), {"attention_mask": mask[1:2, :1]})]  # a one-token request
    for args, kwargs in cases:
        calls.clear()
        got, want = both_paths(model, *args, **kwargs)
        assert len(calls) == layers
        assert_equal(got, want)


@pytest.mark.parametrize("longest", [LONGEST, LONGEST_BASE])
@pytest.mark.parametrize("cls", DROPIN)
def test_every_dropin_class_runs_the_cpp_layer_to_the_python_paths_outputs(cls, longest, calls):
    model = rf.quantize(model_of(cls, longest=longest))
    ids, mask = awkward_inputs(cls, longest=longest)
    got, want = both_paths(model, ids, attention_mask=mask)
    encoder = model.roberta if hasattr(model, "roberta") else model
    rows = ids.view(-1, longest)  # multiple choice: (questions * choices, longest)
    with torch.inference_mode():  # (rows run in groups past cpu_group_tokens in inference only)
        groups = encoder._row_groups(rows, mask.view(-1, longest), None) or [rows]
    assert len(calls) == TINY["num_hidden_layers"] * len(groups)
    assert_equal(got, want)


def test_the_auto_engine_picks_its_library_per_call_in_the_cpp_layer_too(monkeypatch, calls):
    if not has_engine("auto"):
        pytest.skip("needs torch's fbgemm engine and oneDNN's int8 ops")
    model = rf.quantize(model_of("RobertaModel"), engine="auto")
    ids, mask = awkward_inputs("RobertaModel")
    real = int(mask.sum())
    for switch in (real + 1, real):  # fbgemm, then oneDNN (the two differ: test_quantize tells them apart)
        monkeypatch.setattr(rf.quantization, "AUTO_FBGEMM_BELOW_TOKENS", switch)
        got, want = both_paths(model, ids, attention_mask=mask)
        assert_equal(got, want)
    assert len(calls) == 2 * TINY["num_hidden_layers"]


def test_hooks_attention_probabilities_and_gradients_take_the_python_path(calls):
    model = rf.quantize(model_of("RobertaModel"))
    ids, mask = awkward_inputs("RobertaModel")
    seen = []
    handle = model.encoder.layer[0].ffn_in.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    got, want = both_paths(model, ids, attention_mask=mask)
    assert_equal(got, want)
    assert len(seen) == 2 and len(calls) == TINY["num_hidden_layers"] - 1  # layer 0 in Python, both times
    handle.remove()

    handle = model.encoder.layer[1].attn_out.register_forward_pre_hook(lambda module, args: seen.append("attn_out"))
    calls.clear()
    with torch.inference_mode():
        model(ids, attention_mask=mask)
    assert seen[-1] == "attn_out" and len(calls) == TINY["num_hidden_layers"] - 1
    handle.remove()

    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    calls.clear()
    with torch.inference_mode():
        model(ids, attention_mask=mask)
    assert not calls  # a global hook is called for every submodule
    handle.remove()

    calls.clear()
    with torch.inference_mode():
        out = model(ids, attention_mask=mask, output_attentions=True)
    assert not calls and len(out.attentions) == TINY["num_hidden_layers"]

    plain = model_of("RobertaModel")
    plain.encoder.layer[1].ffn_in.register_forward_hook(lambda module, args, out: seen.append("plain ffn_in"))
    with torch.inference_mode():
        plain(ids, attention_mask=mask)
    # the FFN's first Linear is called as a module when hooked (it ran its fused GELU without hooks before)
    assert len(calls) == 1 and seen[-1] == "plain ffn_in"

    calls.clear()
    plain(ids, attention_mask=mask)  # gradients recorded: autograd sees the Python path's ops
    assert not calls


# the modules the layers use by their tensors when unhooked (transformers calls them: their hooks fire)
NORMS = ("roberta.embeddings.token_type_embeddings", "roberta.embeddings.LayerNorm",
         "roberta.encoder.layer.0.attn_LayerNorm", "roberta.encoder.layer.0.ffn_LayerNorm", "lm_head.layer_norm")


@pytest.mark.parametrize("packing", PACKINGS)
def test_hooks_on_the_norms_and_the_token_types_fire_and_their_outputs_are_used(packing, calls):
    skip_without(packing)
    model = PACKINGS[packing](model_of("RobertaForMaskedLM"))
    ids, mask = awkward_inputs("RobertaForMaskedLM")
    model.roberta.unpad, groups = False, model.roberta.cpu_group_tokens
    model.roberta.cpu_group_tokens = None
    with torch.inference_mode():  # as a hooked model runs: whole and padded (hooks see transformers' shapes)
        want = model(ids, attention_mask=mask, output_hidden_states=True)
    model.roberta.unpad, model.roberta.cpu_group_tokens = True, groups
    seen = []
    for name in NORMS:
        module = model.get_submodule(name)
        module.register_forward_pre_hook(lambda module, args, name=name: seen.append("pre " + name))
        module.register_forward_hook(lambda module, args, out, name=name: seen.append(name))
    calls.clear()
    with torch.inference_mode():
        got = model(ids, attention_mask=mask, output_hidden_states=True)
    assert sorted(seen) == sorted(NORMS + tuple("pre " + name for name in NORMS))
    assert len(calls) == 1  # layer 0 (its norms hooked) in Python, layer 1 in C++
    assert_equal([got.logits, *got.hidden_states], [want.logits, *want.hidden_states])  # the modules' values

    model.roberta.encoder.layer[1].ffn_LayerNorm.register_forward_hook(lambda module, args, out: out * 0)
    with torch.inference_mode():
        got = model(ids, attention_mask=mask, output_hidden_states=True)
    assert not got.hidden_states[-1].any() and not torch.equal(got.logits, want.logits)  # the hook's output is used


def test_what_the_python_path_refuses_is_still_refused(calls):
    model = rf.quantize(model_of("RobertaModel"))
    ids, mask = awkward_inputs("RobertaModel")
    model.train()
    with pytest.raises(RuntimeError, match="is for inference: call model.eval"):
        model(ids, attention_mask=mask)
    model.eval()
    with torch.no_grad():
        # the FFN's input holds NaN: no int8 scale covers it
        model.encoder.layer[0].attn_LayerNorm.weight[0] = float("nan")
    with torch.inference_mode(), pytest.raises(ValueError, match="non-finite activation"):
        model(ids, attention_mask=mask)
    assert len(calls) == 1  # refused in the C++ layer, with the Python path's message
    calls.clear()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError,
                                                                                       match="outside torch.autocast"):
        model(ids, attention_mask=mask)  # refused in Python, by the first Linear layer
    assert not calls


def test_export_traces_the_python_path(calls):
    model = rf.quantize(model_of("RobertaModel"))
    model.unpad = False  # export traces the padded path
    ids, mask = awkward_inputs("RobertaModel")
    program = torch.export.export(model, (ids,), {"attention_mask": mask}, strict=False)
    assert not calls
    assert any("int8_linear" in str(node.target) for node in program.graph.nodes)


def test_without_the_compiled_op_the_python_path_runs(monkeypatch):
    """An extension built before the op (a checkout updated without the rebuild), or none at all:
    the same outputs from the Python path, not an AttributeError."""
    from roberta_fast import _ext
    model = model_of("RobertaModel")
    ids, mask = awkward_inputs("RobertaModel")
    with torch.inference_mode():
        want = model(ids, attention_mask=mask).last_hidden_state
    def missing():
        raise ImportError("roberta_fast._C could not be imported")

    stale = types.SimpleNamespace()  # a _C without inference_layer
    try:
        for load in (lambda: stale, missing):
            monkeypatch.setattr(_ext, "load", load)
            _ext.optional.cache_clear()
            with torch.inference_mode():
                assert torch.equal(model(ids, attention_mask=mask).last_hidden_state, want)
    finally:
        _ext.optional.cache_clear()  # before monkeypatch restores load: the real op again


def longest_gap_during(call, attempts: int = 3) -> float:
    """The longest time another Python thread went without running while `call` ran, as a fraction
    of the call's time (the smallest of `attempts` tries). That thread wakes every millisecond, so
    the fraction is small where `call` lets go of the GIL and near 1 where it holds it throughout."""
    fractions = []
    for _ in range(attempts):
        stamps, done = [], threading.Event()

        def tick():
            while not done.is_set():
                stamps.append(time.perf_counter())
                time.sleep(0.001)

        ticker = threading.Thread(target=tick)
        ticker.start()
        time.sleep(0.01)
        start = time.perf_counter()
        call()
        end = time.perf_counter()
        done.set()
        ticker.join()
        inside = [start] + [t for t in stamps if start < t < end] + [end]
        fractions.append(max(b - a for a, b in zip(inside, inside[1:])) / (end - start))
    return min(fractions)


def test_the_cpp_layer_lets_other_python_threads_run(calls):
    """A server's other Python threads (tokenizing, another request) run while a layer computes:
    the C++ op releases the GIL, as each ATen op of the Python path does."""
    torch.manual_seed(0)
    config = rf.RobertaConfig(vocab_size=97, hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                              max_position_embeddings=64)
    layer = RobertaLayer(config).eval()
    x = torch.randn(1, 2048, 256)  # ~70 ms on one layer of a 2-core CPU, 70 of the other thread's ticks
    with torch.inference_mode():
        gap = longest_gap_during(lambda: layer(x))
    assert len(calls) == 3
    assert gap < 0.5, f"the other thread stood still for {gap:.0%} of the layer's call"


@pytest.mark.parametrize("packing", ["plain", "int8-onednn", "int8-fbgemm", "int8-auto"])
def test_requests_served_from_threads_side_by_side_get_their_own_outputs(packing, calls):
    """Serving threads share one model while each layer runs without the GIL: every request's output
    is the one it gets alone, bit for bit (no state shared between calls: the activations' scales,
    auto's library choice, oneDNN's and fbgemm's buffers)."""
    skip_without(packing)
    packings = {**PACKINGS, "int8-auto": lambda m: rf.quantize(m, engine="auto")}
    model = packings[packing](model_of("RobertaModel"))
    g = torch.Generator().manual_seed(1)
    requests = [torch.randint(3, TINY["vocab_size"], (1, int(n)), generator=g)
                for n in torch.randint(1, 40, (24,), generator=g)]  # 1 to 39 tokens: auto uses both libraries
    with torch.inference_mode():
        alone = [model(ids).last_hidden_state for ids in requests]
    served, differing = [], []

    def serve(first):  # three threads, each a third of the requests, five times over
        with torch.inference_mode():
            for _ in range(5):
                for i in range(first, len(requests), 3):
                    out = model(requests[i]).last_hidden_state
                    served.append(i)
                    if not torch.equal(out, alone[i]):
                        differing.append(i)

    threads = [threading.Thread(target=serve, args=(first,)) for first in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(served) == sorted(list(range(len(requests))) * 5)
    assert len(calls) == TINY["num_hidden_layers"] * len(requests) * 6  # the C++ layer: alone, then in threads
    assert not differing, f"requests {sorted(set(differing))} differ from their outputs alone"
