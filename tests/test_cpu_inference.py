"""CPU inference runs padded batches unpadded (ops.unpad_impl): parity with transformers.

Under torch.no_grad / torch.inference_mode the reference backend on the CPU drops the
padding at the embeddings and runs attention per sequence (ops.attention_varlen_sdpa);
real positions equal transformers', padded ones are zeros (as the fused unpadded path
gives them). With gradients recorded, uniform lengths, or output_attentions, the batch
runs padded as before. Batches of more than cpu_group_tokens tokens run in groups of rows. torch.compile on this path (no recompile per batch shape) is
checked by benchmarks/bench_inference.py's rf-compile contender: compiling takes ~35 s here.
"""
import pytest
import torch

import roberta_fast as rf
from roberta_fast import ops

from test_inference_layer import count_layer_calls

transformers = pytest.importorskip("transformers")

FIELDS = dict(vocab_size=71, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=48, max_position_embeddings=24, type_vocab_size=1, layer_norm_eps=1e-5)


def hf_model(cls, **extra):
    torch.manual_seed(0)
    model = getattr(transformers, cls)(transformers.RobertaConfig(**{**FIELDS, **extra})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def batch(pattern, seed=0):
    """(ids, mask) of 4 rows of 22 tokens, padded right, left, with holes, or one row fully padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, FIELDS["vocab_size"], (4, 22), generator=g)
    lengths = torch.tensor([22, 1, 9, 17])
    pos = torch.arange(22)[None]
    mask = {"right": pos < lengths[:, None],
            "left": pos >= 22 - lengths[:, None],
            "holes": torch.rand(4, 22, generator=g) < 0.5,
            "empty-row": pos < torch.tensor([22, 0, 9, 17])[:, None]}[pattern]
    if pattern == "holes":
        mask[:, 0] = True
    else:
        ids[~mask] = 1
    return ids, mask.long()


@pytest.fixture
def sdpa_calls(monkeypatch):
    """How many layers ran the unpadded CPU attention: in Python (ops.attention_varlen_sdpa), or in
    the C++ inference layer (csrc/inference_layer.cpp) given cu_seqlens."""
    calls = []
    original = ops.attention_varlen_sdpa
    monkeypatch.setattr(ops, "attention_varlen_sdpa", lambda *a: calls.append(1) or original(*a))
    return count_layer_calls(monkeypatch, calls, unpadded_only=True)


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("pattern", ["right", "left", "holes", "empty-row"])
def test_encoder_runs_unpadded_and_matches_transformers(pattern, sdpa_calls):
    """Batches whose every row attends its first token run unpadded (zeros at padded positions, as
    the fused path); left padding or an all-padding row runs padded, so that the pooler and the
    classification heads, which read position 0, see transformers' hidden state there, not a zero.
    An all-padding row is transformers' eager attention's (uniform weights); its SDPA gives another."""
    hf = hf_model("RobertaModel")
    ours = rf.RobertaModel.from_pretrained(hf).eval()  # backend "auto": the reference one on the CPU
    if pattern == "empty-row":
        hf.set_attn_implementation("eager")
    ids, mask = batch(pattern)
    with torch.inference_mode():
        want = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        got = ours(ids, attention_mask=mask, output_hidden_states=True)
    unpadded = pattern in ("right", "holes")
    assert len(sdpa_calls) == (FIELDS["num_hidden_layers"] if unpadded else 0)
    real = mask.bool()
    for a, b in zip(got.hidden_states, want.hidden_states, strict=True):
        assert max_rel(a[real], b[real]) < 1e-5
        if unpadded:
            assert (a[~real] == 0).all()  # re-padded with zeros, as the fused unpadded path
        else:
            assert max_rel(a, b) < 1e-5
    assert max_rel(got.pooler_output, want.pooler_output) < 1e-5


def test_every_row_fully_padded_runs_padded_as_transformers_eager(sdpa_calls):
    hf = hf_model("RobertaModel")
    ours = rf.RobertaModel.from_pretrained(hf).eval()
    hf.set_attn_implementation("eager")
    ids, mask = torch.ones(3, 5, dtype=torch.long), torch.zeros(3, 5, dtype=torch.long)
    with torch.no_grad():
        out, want = ours(ids, attention_mask=mask), hf(input_ids=ids, attention_mask=mask)
    assert len(sdpa_calls) == 0
    assert max_rel(out.last_hidden_state, want.last_hidden_state) < 1e-5


@pytest.mark.parametrize("cls", ["RobertaForSequenceClassification", "RobertaForMaskedLM"])
def test_classifier_and_mlm_run_unpadded(cls, sdpa_calls):
    hf = hf_model(cls, num_labels=3)
    ours = getattr(rf, cls).from_pretrained(hf).eval()
    ids, mask = batch("right", seed=1)
    with torch.no_grad():
        want, got = hf(input_ids=ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert len(sdpa_calls) == FIELDS["num_hidden_layers"]
    real = mask.bool() if want.dim() == 3 else slice(None)
    assert max_rel(got[real], want[real]) < 1e-5


def test_padded_path_where_unpadding_does_not_apply(sdpa_calls):
    """Gradients recorded, nothing padded, output_attentions, or unpad off: transformers' values everywhere."""
    hf = hf_model("RobertaModel")
    hf.set_attn_implementation("eager")  # returns the attention probabilities
    ours = rf.RobertaModel.from_pretrained(hf).eval()
    ids, mask = batch("right", seed=2)
    want = hf(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert max_rel(ours(ids, attention_mask=mask).last_hidden_state, want.last_hidden_state) < 1e-5
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, output_attentions=True)
        assert max_rel(got.last_hidden_state, want.last_hidden_state) < 1e-5
        for a, b in zip(got.attentions, want.attentions, strict=True):
            assert max_rel(a, b) < 1e-5
        uniform = torch.ones_like(mask)
        assert max_rel(ours(ids, attention_mask=uniform).last_hidden_state,
                       hf(input_ids=ids, attention_mask=uniform).last_hidden_state) < 1e-5
        ours.unpad = False
        assert max_rel(ours(ids, attention_mask=mask).last_hidden_state, want.last_hidden_state) < 1e-5
    assert not sdpa_calls


@pytest.mark.parametrize("pattern", ["right", "holes"])
def test_large_batches_run_in_groups_of_rows_and_match_transformers(pattern, sdpa_calls, monkeypatch):
    """Past cpu_group_tokens (here 20 of the batch's 49 or so real tokens) encode runs consecutive
    groups of rows and concatenates their outputs: transformers' values, every output field."""
    hf = hf_model("RobertaModel")
    ours = rf.RobertaModel.from_pretrained(hf).eval()
    ours.cpu_group_tokens = 20
    ids, mask = batch(pattern, seed=3)
    groups = []
    original = ours._encode
    monkeypatch.setattr(ours, "_encode", lambda ids, *a, **k: groups.append(len(ids)) or original(ids, *a, **k))
    with torch.inference_mode():
        want = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        got = ours(ids, attention_mask=mask, output_hidden_states=True)
    lengths = mask.sum(1).tolist()
    if pattern == "right":  # rows of 22, 1, 9 and 17 tokens: 22 alone (over the limit), 1 + 9, 17
        assert lengths == [22, 1, 9, 17] and groups == [1, 2, 1]
        # the two padded groups ran unpadded (the first, one full row, has nothing to unpad)
        assert len(sdpa_calls) == FIELDS["num_hidden_layers"] * 2
    assert len(groups) > 1 and sum(groups) == 4
    real = mask.bool()
    for a, b in zip(got.hidden_states, want.hidden_states, strict=True):
        assert a.shape == b.shape and max_rel(a[real], b[real]) < 1e-5
        assert (a[~real] == 0).all()
    assert max_rel(got.pooler_output[real[:, 0]], want.pooler_output[real[:, 0]]) < 1e-5
    ours.cpu_group_tokens = None  # the whole batch in one go: the same values
    with torch.inference_mode():
        whole = ours(ids, attention_mask=mask, output_hidden_states=True)
    assert groups[-1] == 4
    torch.testing.assert_close(got.last_hidden_state, whole.last_hidden_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pattern", ["left", "empty-row"])
def test_a_batch_that_runs_padded_runs_padded_in_every_group(pattern, sdpa_calls):
    """A row whose first token is masked makes the batch run padded, with transformers' values at every
    position; grouped, the groups without such a row once ran unpadded (zeros at their pads)."""
    hf = hf_model("RobertaForTokenClassification", num_labels=3)
    ours = rf.RobertaForTokenClassification.from_pretrained(hf).eval()
    ours.roberta.cpu_group_tokens = 30
    ids, mask = batch(pattern, seed=5)
    if pattern == "empty-row":
        hf.set_attn_implementation("eager")  # transformers' SDPA and eager differ on an all-padding row
    with torch.inference_mode():
        want, got = hf(input_ids=ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
        assert ours.roberta._row_groups(ids, mask, None) is not None
    assert max_rel(got, want) < 1e-5 and not sdpa_calls


def test_row_groups_keep_every_input_and_head_output():
    """Grouped: token types, positions, inputs_embeds, attentions and a head's logits all follow their rows."""
    hf = hf_model("RobertaForSequenceClassification", num_labels=3, type_vocab_size=2)
    hf.set_attn_implementation("eager")  # returns the attention probabilities
    ours = rf.RobertaForSequenceClassification.from_pretrained(hf).eval()
    ours.roberta.cpu_group_tokens = 30
    ids, mask = batch("right", seed=4)
    types = (torch.arange(22) > 10).long().expand(4, 22)
    positions = torch.arange(2, 24).expand(4, 22)
    embeds = hf.roberta.embeddings.word_embeddings(ids).detach()
    inputs = dict(attention_mask=mask, token_type_ids=types, position_ids=positions, output_attentions=True)
    with torch.no_grad():
        for kind in ("input_ids", "inputs_embeds"):
            source = {"input_ids": ids} if kind == "input_ids" else {"inputs_embeds": embeds}
            want, got = hf(**source, **inputs), ours(**source, **inputs)
            assert ours.roberta._row_groups(ids, mask, None) == [slice(0, 2), slice(2, 4)]
            assert max_rel(got.logits, want.logits) < 1e-5, kind
            for a, b in zip(got.attentions, want.attentions, strict=True):
                assert a.shape == b.shape and max_rel(a, b) < 1e-5, kind
        # unchecked inputs may broadcast one row over an unpadded batch, as in transformers: every group gets it
        ours.check_inputs = False
        full = torch.ones_like(mask)
        broadcast = ours(ids, attention_mask=full, token_type_ids=types[:1], position_ids=positions[:1]).logits
        assert ours.roberta._row_groups(ids, full, None) == [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4)]
        assert max_rel(broadcast, hf(input_ids=ids, **{**inputs, "attention_mask": full}).logits) < 1e-5


def test_no_row_groups_with_gradients_packed_rows_or_small_batches():
    ours = rf.RobertaModel.from_pretrained(hf_model("RobertaModel")).eval()
    ours.cpu_group_tokens = 20
    ids, mask = batch("right")
    assert ours._row_groups(ids, mask, None) is None  # gradients recorded: training runs the batch whole
    with torch.no_grad():
        assert ours._row_groups(ids, mask, None) == [slice(0, 1), slice(1, 3), slice(3, 4)]
        assert ours._row_groups(ids, mask, torch.tensor([0, 40, 88], dtype=torch.int32)) is None
        assert ours._row_groups(ids[:1, :20], mask[:1, :20], None) is None  # within the limit
        ours.unpad = False  # every row costs its padded length: 22 each
        assert ours._row_groups(ids, mask, None) == [slice(i, i + 1) for i in range(4)]
        ours.cpu_group_tokens = None
        assert ours._row_groups(ids, mask, None) is None



def test_unpadded_cpu_attention_runs_sdpas_flash_kernel():
    """Each sequence's SDPA call gets 4-D inputs, which the CPU flash kernel takes (3-D ones fall back to the
    math path: bmm, softmax and masking ops, 3x slower at roberta-base's heads)."""
    qkv = torch.randn(13, 3, 2, 16)  # (total_tokens, 3, heads, head_dim): sequences of 9 and 4 tokens
    cu_seqlens = torch.tensor([0, 9, 13], dtype=torch.int32)
    with torch.profiler.profile() as prof:
        out = ops.attention_varlen_sdpa(qkv, cu_seqlens, 0.0)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names and "aten::bmm" not in names, names
    q, k, v = (t[9:].transpose(0, 1) for t in qkv.unbind(1))  # the second sequence, (heads, 4, head_dim)
    want = torch.softmax(q @ k.transpose(-1, -2) / 4, dim=-1) @ v
    torch.testing.assert_close(out[9:].transpose(0, 1), want, rtol=1e-5, atol=1e-5)
