"""The drop-in task heads against transformers' own classes, for the same weights.

RobertaForTokenClassification, RobertaForQuestionAnswering and RobertaForMultipleChoice on
awkward configurations (head dim 8 and 128, odd FFN widths, three token types, random
padding): outputs, losses and every parameter's gradient; loading from a transformers
object and a directory; save_pretrained -> transformers' Auto class -> the same logits.
The reference backend runs each configuration, the fused one (Triton interpreter, unpadded
variable-length attention) head dim 128, the one of the two its attention kernel takes.
"""
import pytest
import torch

import roberta_fast as rf
from roberta_fast.hf import native_to_hf

transformers = pytest.importorskip("transformers")

CONFIGS = {  # head dim 8, FFN 37; head dim 128, FFN 53
    "hd8": dict(vocab_size=67, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                max_position_embeddings=20, type_vocab_size=3),
    "hd128": dict(vocab_size=67, hidden_size=128, num_hidden_layers=1, num_attention_heads=1, intermediate_size=53,
                  max_position_embeddings=20, type_vocab_size=3),
}
RUNS = [("hd8", "reference"), ("hd128", "reference"), ("hd128", "fused")]  # fused: unpadded varlen attention
AUTO = {"RobertaForTokenClassification": "AutoModelForTokenClassification",
        "RobertaForQuestionAnswering": "AutoModelForQuestionAnswering",
        "RobertaForMultipleChoice": "AutoModelForMultipleChoice"}


def hf_model(cls, fields, **extra):
    """transformers' `cls` with every weight (biases and LayerNorms too) perturbed off its init."""
    torch.manual_seed(0)
    model = getattr(transformers, cls)(transformers.RobertaConfig(**fields, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def batch(fields, shape=(3, 13), seed=0):
    """ids, a random right-padding mask (a full row, a one-token row) and token types of every kind."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, fields["vocab_size"], shape, generator=g)
    seqlen = shape[-1]
    lengths = torch.randint(1, seqlen + 1, shape[:-1], generator=g).flatten()
    lengths[0], lengths[-1] = seqlen, 1
    mask = (torch.arange(seqlen) < lengths.view(*shape[:-1], 1)).long()
    ids[mask == 0] = 1  # <pad>
    types = torch.randint(0, fields["type_vocab_size"], shape, generator=g)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types)


def check_parity(cls, config, backend, inputs, outputs, tmp_path, unpad=True, **extra):
    """ours vs transformers: `outputs` (names; per-token ones where attended), the loss and every
    gradient, then save_pretrained -> transformers' Auto class with no missing or unexpected key."""
    fields = CONFIGS[config]
    hf = hf_model(cls, fields, **extra)
    ours = getattr(rf, cls).from_pretrained(hf, backend=backend).eval()
    ours.roberta.unpad = unpad
    expected, actual = hf(**inputs), ours(**inputs)
    valid = inputs["attention_mask"].bool()
    for name in outputs:
        want, got = getattr(expected, name), getattr(actual, name)
        if want.shape[:valid.dim()] == valid.shape:  # per-token outputs: padded positions are not compared
            want, got = want[valid], got[valid]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5, msg=name)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-6)
    expected.loss.backward()
    actual.loss.backward()
    grads = native_to_hf({n: p.grad for n, p in ours.named_parameters()}, prefix="roberta.")
    for name, p in hf.named_parameters():
        if p.grad is None:
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=2e-6, msg=name)

    ours.save_pretrained(tmp_path)
    auto = getattr(transformers, AUTO[cls])
    back, info = auto.from_pretrained(tmp_path, output_loading_info=True)
    assert all(not v for v in info.values()), info
    again = back.eval()(**{k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask",
                                                                   "token_type_ids")})
    for name in outputs:
        torch.testing.assert_close(getattr(again, name), getattr(expected, name), msg=name)
    return ours, hf


@pytest.mark.parametrize("config, backend", RUNS)
def test_token_classification_matches_transformers(config, backend, tmp_path):
    inputs = batch(CONFIGS[config])
    labels = torch.randint(0, 5, inputs["input_ids"].shape)
    labels[inputs["attention_mask"] == 0] = -100
    labels[:, 0] = -100  # <s>, as the field labels only first sub-tokens
    ours, _ = check_parity("RobertaForTokenClassification", config, backend, {**inputs, "labels": labels},
                           ["logits"], tmp_path, num_labels=5)
    if backend == "fused":  # it ran unpadded: padded positions re-padded with zero hidden states
        padded = ours(**inputs).logits[inputs["attention_mask"] == 0]
        torch.testing.assert_close(padded, ours.classifier.bias.expand_as(padded))


def test_token_classification_from_a_directory_and_its_refusals(tmp_path):
    fields = CONFIGS["hd8"]
    hf_model("RobertaForTokenClassification", fields, num_labels=4).save_pretrained(tmp_path)
    ours = rf.RobertaForTokenClassification.from_pretrained(tmp_path)
    assert ours.num_labels == 4 and ours.config.id2label[3] == "LABEL_3"
    inputs = batch(fields)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
        ours(**inputs, labels=torch.full(inputs["input_ids"].shape, 4))
    with pytest.raises(ValueError, match="shaped like input_ids"):
        ours(**inputs, labels=torch.zeros(3, dtype=torch.long))
    out = ours(**inputs, return_dict=False)
    assert isinstance(out, tuple) and out[0].shape == (3, 13, 4)


@pytest.mark.parametrize("config, backend", RUNS)
def test_question_answering_matches_transformers(config, backend, tmp_path):
    inputs = batch(CONFIGS[config])
    start = torch.tensor([2, 40, -3])  # 40: past the window, clamped to seqlen and ignored; -3: clamped to 0
    end = torch.tensor([[5], [40], [0]])  # (batch, 1), as HF squeezes it
    # the loss's softmax spans padded positions, whose logits unpadding does not compute as HF does
    ours, _ = check_parity("RobertaForQuestionAnswering", config, backend,
                           {**inputs, "start_positions": start, "end_positions": end},
                           ["start_logits", "end_logits"], tmp_path, unpad=False)
    with pytest.raises(ValueError, match=r"start_positions must be an integer tensor .* shape \(3,\)"):
        ours(**inputs, start_positions=torch.zeros(2, dtype=torch.long), end_positions=end)


@pytest.mark.parametrize("config, backend", RUNS)
def test_multiple_choice_matches_transformers(config, backend, tmp_path):
    inputs = batch(CONFIGS[config], shape=(2, 3, 11))  # 2 questions of 3 choices, padded per choice
    ours, _ = check_parity("RobertaForMultipleChoice", config, backend, {**inputs, "labels": torch.tensor([2, 0])},
                           ["logits"], tmp_path)
    with pytest.raises(ValueError, match=r"input_ids must have shape \(batch, num_choices, seqlen\)"):
        ours(inputs["input_ids"][0])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        ours(**inputs, labels=torch.tensor([3, 0]))
    with pytest.raises(ValueError, match="the shape of input_ids"):
        ours(inputs["input_ids"], attention_mask=inputs["attention_mask"][:, :2])
