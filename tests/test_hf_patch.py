"""rf.patch beyond fidelity (tests/test_dropin.py has that): a patched model's copies,
DataParallel replicas and pickles compute with their own weights; dtypes the kernels
do not take (float64) run the reference ops."""
import copy
import io
import os
import subprocess
import sys

import pytest
import torch

import roberta_fast as rf

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

FIELDS = dict(vocab_size=53, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=64, max_position_embeddings=20, type_vocab_size=1)


def hf_model(cls="RobertaForMaskedLM"):
    torch.manual_seed(0)
    return getattr(transformers, cls)(transformers.RobertaConfig(**FIELDS)).eval()


def test_a_data_parallel_replica_computes_with_its_own_weights():
    """replicate() copies __dict__ shallowly: a forward bound to the instance would keep
    computing with the original module's weights on every device."""
    inter = rf.patch(hf_model("RobertaModel")).encoder.layer[0].intermediate
    replica = inter._replicate_for_data_parallel()
    replica._modules["dense"] = copy.deepcopy(inter.dense)  # what replicate() installs next
    with torch.no_grad():
        replica.dense.weight.zero_()
        replica.dense.bias.zero_()
    assert bool((replica(torch.randn(2, FIELDS["hidden_size"])) == 0).all())  # GELU(0)


def test_a_deep_copy_computes_with_its_own_weights():
    model = rf.patch(hf_model())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.roberta.encoder.layer[0].output.parameters():
            p.add_(1.0)
    ids = torch.randint(3, 52, (2, 7))
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, twin(input_ids=ids).logits)


def test_a_patched_model_pickles(tmp_path):
    """torch.save(model) pickles the whole model, the patched classes included, and loads
    in a fresh process, still patched and giving the same outputs."""
    model = rf.patch(hf_model())
    ids = torch.randint(3, 52, (2, 7))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.lm_head) is type(model.lm_head)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want)
    torch.save({"model": model, "ids": ids, "want": want}, tmp_path / "m.pt")
    code = ("import torch, roberta_fast\n"
            f"d = torch.load({str(tmp_path / 'm.pt')!r}, weights_only=False)\n"
            "with torch.no_grad(): got = d['model'](input_ids=d['ids']).logits\n"
            "assert torch.equal(got, d['want']), (got - d['want']).abs().max()\n"
            "assert type(d['model'].lm_head).forward.__module__ == 'roberta_fast.hf_patch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def test_patching_twice_keeps_one_patched_class():
    model = rf.patch(hf_model())
    cls = type(model.lm_head)
    rf.patch(model)
    assert type(model.lm_head) is cls and type(model.lm_head).__mro__[2] is transformers.models.roberta.modeling_roberta.RobertaLMHead


@pytest.mark.parametrize("cls", ["RobertaModel", "RobertaForMaskedLM"])
def test_a_float64_model_runs_the_reference_ops(cls):
    """No kernel takes float64: a patched float64 model computes as transformers does
    (here on the CPU under the interpreter, where the kernels would otherwise run)."""
    original = hf_model(cls).double()
    patched = rf.patch(copy.deepcopy(original))
    ids = torch.randint(3, 52, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        want, got = (m(input_ids=ids, attention_mask=mask)[0] for m in (original, patched))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)



def test_wrapped_and_hooked_layers_run_as_in_transformers():
    """A fused forward reads nn.Linear / nn.LayerNorm weights directly; a layer that is another class
    (PEFT's LoRA, quantized, bitsandbytes layers), hooked or offloaded must run as transformers runs it."""

    class Shifted(torch.nn.Linear):  # stands for a LoRA-wrapped or quantized layer
        def forward(self, x):
            return super().forward(x) + 0.5

    original = hf_model()
    layer = original.roberta.encoder.layer[0]
    for parent in (layer.intermediate, original.lm_head):
        shifted = Shifted(parent.dense.in_features, parent.dense.out_features)
        shifted.load_state_dict(parent.dense.state_dict())
        parent.dense = shifted
    patched = rf.patch(copy.deepcopy(original))
    ids = torch.randint(3, 52, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, original(input_ids=ids).logits)
    patched = rf.patch(hf_model())  # plain layers: the fused forwards run, but must call hooked modules
    fired = []
    hooked = ("roberta.encoder.layer.0.intermediate.intermediate_act_fn", "roberta.encoder.layer.0.output.LayerNorm",
              "lm_head.layer_norm")
    for name in hooked:
        patched.get_submodule(name).register_forward_hook(lambda *_, name=name: fired.append(name))
    with torch.no_grad():
        patched(input_ids=ids)
    assert fired == list(hooked)


@pytest.mark.parametrize("scope", ["module", "global"])
def test_backward_hooks_on_fused_modules_run_as_in_transformers(scope):
    """A full backward hook on a module the fused forwards skip (the LayerNorms, the FFN's dense and
    GELU, the MLM head's) must fire and may change the gradients, as in transformers. Before, only
    forward hooks were looked for: the hooks never fired and the gradients were unhooked ones."""
    original = hf_model()
    patched = rf.patch(copy.deepcopy(original))
    names = ("roberta.encoder.layer.0.attention.output.LayerNorm", "roberta.encoder.layer.0.intermediate.dense",
             "roberta.encoder.layer.0.intermediate.intermediate_act_fn", "lm_head.layer_norm")
    ids = torch.randint(3, 52, (2, 7))
    grads, fired = [], []
    for model in (original, patched):
        def halve(module, grad_input, grad_output, model=model):
            fired.append(model is patched)
            return tuple(None if g is None else g * 0.5 for g in grad_input)
        if scope == "module":
            handles = [model.get_submodule(name).register_full_backward_hook(halve) for name in names]
        else:
            handles = [torch.nn.modules.module.register_module_full_backward_hook(halve)]
        model.zero_grad()
        model(input_ids=ids).logits.square().mean().backward()
        for handle in handles:
            handle.remove()
        grads.append(model.roberta.embeddings.word_embeddings.weight.grad)
    assert fired.count(True) == fired.count(False) > 0
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("activation", [torch.nn.ReLU(), torch.nn.SiLU()], ids=["relu", "silu"])
def test_an_activation_put_in_place_of_gelu_is_computed(activation):
    """The fused FFN computes erf GELU: another activation module set as intermediate_act_fn (before or
    after patching) runs instead, as in transformers (it was ignored: erf GELU went on being computed;
    a tanh GELU too, 2e-6 off here)."""
    original = hf_model()
    original.roberta.encoder.layer[0].intermediate.intermediate_act_fn = activation
    ids = torch.randint(3, 52, (2, 7))
    with torch.no_grad():
        want = original(input_ids=ids).logits
        torch.testing.assert_close(rf.patch(copy.deepcopy(original))(input_ids=ids).logits, want)
        patched = rf.patch(hf_model())
        patched.roberta.encoder.layer[0].intermediate.intermediate_act_fn = activation
        torch.testing.assert_close(patched(input_ids=ids).logits, want)


def test_a_traced_or_onnx_exported_patched_model_with_kernel_sized_heads_runs(tmp_path):
    """Heads of 64 (every released RoBERTa's) take the fused attention kernel: torch.jit.trace failed
    there (TorchScript holds no uint8 view of the bool mask) and the ONNX export found no translation
    of the kernel; both now record the reference ops, as the drop-in models' do."""
    torch.manual_seed(0)
    config = transformers.RobertaConfig(**{**FIELDS, "hidden_size": 64, "num_attention_heads": 1})
    original = transformers.RobertaModel(config).eval()
    patched = rf.patch(copy.deepcopy(original))
    ids = torch.randint(3, 52, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    traced = torch.jit.trace(patched, (ids, mask), strict=False)
    with torch.no_grad():
        want = original(input_ids=ids, attention_mask=mask)[0]
        got = traced(ids, mask)["last_hidden_state"]
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()])
    import onnxruntime as ort  # (in the test extras)
    torch.onnx.export(patched, (ids, {"attention_mask": mask}), tmp_path / "patched.onnx",
                      input_names=["input_ids", "attention_mask"], dynamo=True)
    session = ort.InferenceSession(str(tmp_path / "patched.onnx"))
    got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got)[mask.bool()], want[mask.bool()])


def test_the_mask_function_takes_every_transformers_5_call():
    """transformers 5.0-5.4 call the mask function with cache_position and no q_length, later ones with
    q_length: only the padding mask and kv_length are read."""
    from roberta_fast.hf_patch import _padding_mask

    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    old = _padding_mask(batch_size=2, cache_position=torch.arange(3), kv_length=3, kv_offset=0, attention_mask=mask)
    new = _padding_mask(2, 3, 3, 0, 0, None, mask)
    assert torch.equal(old, mask) and torch.equal(new, mask)
    assert _padding_mask(batch_size=2, kv_length=3, attention_mask=torch.ones(2, 3, dtype=torch.bool)) is None


def test_dropout_follows_its_own_module_as_in_transformers():
    """Monte Carlo dropout (model.eval(), the Dropout modules .train()) drops; a train-mode model
    whose Dropout modules are .eval() does not: transformers' modules decide by their own flag."""
    torch.manual_seed(0)  # no attention dropout: transformers ties it to the attention module's own flag
    model = rf.patch(transformers.RobertaModel(transformers.RobertaConfig(**FIELDS, attention_probs_dropout_prob=0.0)))
    ids = torch.randint(3, 52, (2, 7))
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.train()
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids)[0], model(input_ids=ids)[0])
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids)[0], model(input_ids=ids)[0])


def test_a_traced_or_exported_patched_model_keeps_the_padding():
    """Traced on a batch with no padding, the graph must still mask the padding of later batches
    (flash attention's mask function drops an all-ones mask by a data-dependent check), and
    torch.export must not stop at that check."""
    original = hf_model("RobertaModel")
    patched = rf.patch(copy.deepcopy(original))
    ids = torch.randint(3, 52, (2, 7))
    traced = torch.jit.trace(patched, (ids, torch.ones(2, 7, dtype=torch.long)), strict=False)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    with torch.no_grad():
        want = original(input_ids=ids, attention_mask=mask)[0]
        got = traced(ids, mask)["last_hidden_state"]
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()])
        exported = torch.export.export(patched, (ids, torch.ones(2, 7, dtype=torch.long)), strict=False)
        got = exported.module()(ids, mask)[0]
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()])
