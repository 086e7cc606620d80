"""Bad inputs give a ValueError naming the problem before any kernel runs."""
import pytest
import torch

import roberta_fast as rf


@pytest.fixture(scope="module")
def model():
    cfg = rf.RobertaConfig.preset("tiny", vocab_size=50, max_position_embeddings=18)  # 16 tokens
    return rf.RobertaForMaskedLM(cfg).eval()


def ids(batch=2, seqlen=8, high=50):
    return torch.randint(3, high, (batch, seqlen))


@pytest.mark.parametrize("make, message", [
    (lambda: ids(high=51).index_fill_(1, torch.tensor([3]), 50), r"input_ids holds values in \[\d+, 50\]"),
    (lambda: ids().index_fill_(1, torch.tensor([0]), -1), r"must lie in \[0, 50\)"),
    (lambda: ids(seqlen=17), "sequence length 17 exceeds the position table"),
    (lambda: ids().float(), "integer token ids"),
    (lambda: ids()[0], r"shape \(batch, seqlen\)"),
    (lambda: [[1, 2, 3]], "must be a torch.Tensor"),
    (lambda: ids(batch=0), r"the batch is empty: input_ids has shape \(0, 8\)"),
    (lambda: ids(seqlen=0), r"the batch is empty: input_ids has shape \(2, 0\)"),
])
def test_bad_input_ids(model, make, message):
    with pytest.raises(ValueError, match=message):
        model(make())


def test_attention_mask_of_wrong_shape(model):
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids \(2, 8\)"):
        model(ids(), attention_mask=torch.ones(2, 9))


def test_token_type_ids_out_of_range(model):
    with pytest.raises(ValueError, match="token_type_ids holds values"):
        model(ids(), token_type_ids=torch.ones(2, 8, dtype=torch.long))


def test_labels_of_wrong_shape(model):
    with pytest.raises(ValueError, match="labels must be a tensor shaped like input_ids"):
        model(ids(), labels=torch.zeros(2, 7, dtype=torch.long))


@pytest.mark.parametrize("bad", [50, -1, -99])
def test_labels_out_of_range(model, bad):
    """A label the vocabulary lacks would be a device-side assert in PyTorch's loss (or, in the
    fused loss, a NaN): it is refused up front, in the same host sync as the id checks."""
    labels = torch.full((2, 8), -100)
    labels[1, 3] = bad
    with pytest.raises(ValueError, match=r"labels holds values .* must lie in \[0, 50\) \(or -100"):
        model(ids(), labels=labels)
    labels[1, 3] = 49
    assert torch.isfinite(model(ids(), labels=labels).loss)


def test_labels_must_be_integers(model):
    with pytest.raises(ValueError, match="labels must be an integer tensor"):
        model(ids(), labels=torch.zeros(2, 8))


def test_encoder_checks_too():
    encoder = rf.RobertaModel(rf.RobertaConfig.preset("tiny", vocab_size=50))
    with pytest.raises(ValueError, match="input_ids holds values"):
        encoder(torch.full((1, 4), 99))


def test_valid_int32_ids_and_bool_mask_work(model):
    x = ids().int()
    mask = torch.ones(2, 8, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(model(x, attention_mask=mask).logits, model(x.long()).logits)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        rf.RobertaForMaskedLM(rf.RobertaConfig.preset("tiny"), backend="cuda")
