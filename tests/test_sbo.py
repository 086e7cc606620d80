"""Tests of roberta_fast/sbo.py: the SpanBERT span boundary head, fused and reference,
against `span_boundary_loss_ref` (the formula, token by token): loss and every gradient."""
import warnings

import pytest
import torch

from roberta_fast.config import RobertaConfig
from roberta_fast.sbo import SpanBoundaryHead, span_boundary_loss_ref

IGNORE = -100


def spans_of(labels):
    """(left, right, offset) per token from a plain reading of the labels: a span is a
    maximal run of predicted tokens; no token after a run at the row's end: -1."""
    batch, seqlen = labels.shape
    spans = torch.full((batch, seqlen, 3), -1, dtype=torch.int64)
    for b in range(batch):
        i = 0
        while i < seqlen:
            if labels[b, i] == IGNORE:
                i += 1
                continue
            s = i
            while i < seqlen and labels[b, i] != IGNORE:
                i += 1
            e = i - 1
            for j in range(s, e + 1):
                spans[b, j] = torch.tensor([s - 1, e + 1 if e + 1 < seqlen else -1, j - s])
    return spans


def awkward_batch(vocab):
    """Rows of 13 tokens: a span right after <s>, one before </s>, a long one past the
    offset cap, one touching the row's end, and a row with nothing predicted."""
    ids = torch.randint(4, vocab, (4, 13))
    labels = torch.full_like(ids, IGNORE)
    for b, runs in enumerate([[(1, 3), (5, 5), (7, 11)], [(2, 10)], [(9, 12)], []]):
        for s, e in runs:
            labels[b, s:e + 1] = ids[b, s:e + 1]
    return labels


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_head_equals_the_formula(backend):
    cfg = RobertaConfig(vocab_size=37, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32)
    head = SpanBoundaryHead(cfg, max_offset=6)  # the 9-token span of row 1 runs past it
    for p in head.parameters():  # nothing left at its init (zero bias, unit LayerNorm)
        torch.nn.init.normal_(p, std=0.3)
    hidden = torch.randn(4, 13, 16, requires_grad=True)
    decoder = torch.randn(37, 16, requires_grad=True)
    labels = awkward_batch(37)
    spans = spans_of(labels)

    loss, count = head(hidden, labels, spans, decoder, backend=backend)
    ref = span_boundary_loss_ref(head, hidden, labels, spans, decoder)
    # rows 0-2 hold 3+1+5 | 6 of 9 (offsets >= 6 dropped) | 0 (the span touches the end) targets
    assert count == 9 + 6
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    inputs = [hidden, decoder, *head.parameters()]
    grads = torch.autograd.grad(loss, inputs)
    grads_ref = torch.autograd.grad(ref, inputs)
    names = ["hidden", "decoder"] + [n for n, _ in head.named_parameters()]
    for name, g, r in zip(names, grads, grads_ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)
    assert grads[0][3].abs().sum() == 0 and grads[0][0, 1:4].abs().sum() == 0  # only boundaries are read
    total, n = head(hidden, labels, spans, decoder, backend=backend, reduction="sum")
    torch.testing.assert_close(total / n, loss)


def test_fused_matches_reference_under_fp16_autocast():
    cfg = RobertaConfig(vocab_size=37, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32)
    head = SpanBoundaryHead(cfg)
    hidden = torch.randn(4, 13, 16)
    decoder = torch.randn(37, 16)
    labels = awkward_batch(37)
    spans = spans_of(labels)
    with torch.autocast("cpu", dtype=torch.float16):
        fused, _ = head(hidden, labels, spans, decoder, backend="fused")
        reference, _ = head(hidden, labels, spans, decoder, backend="reference")
    exact = span_boundary_loss_ref(head, hidden, labels, spans, decoder)
    assert fused.dtype == torch.float32
    assert abs(fused - exact) <= 2 * abs(reference - exact) + 2e-3


def tiny_spanbert(backend="reference", **kwargs):
    from roberta_fast.sbo import RobertaForSpanBERT

    cfg = RobertaConfig(vocab_size=37, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=20, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return RobertaForSpanBERT(cfg, backend=backend, **kwargs)


def test_spanbert_model_is_mlm_plus_sbo_on_one_encoder_pass():
    from roberta_fast.model import RobertaForMaskedLM

    model = tiny_spanbert()
    ids = torch.randint(4, 37, (4, 13))
    labels = awkward_batch(37)
    spans = spans_of(labels)
    out = model(ids, labels=labels, spans=spans)
    mlm = RobertaForMaskedLM(model.config, backend="reference")
    mlm.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("sbo.")})
    torch.testing.assert_close(out.mlm_loss, mlm(ids, labels=labels).loss)
    hidden = model.roberta(ids).last_hidden_state
    decoder = model.roberta.embeddings.word_embeddings.weight
    torch.testing.assert_close(out.sbo_loss, span_boundary_loss_ref(model.sbo, hidden, labels, spans, decoder))
    torch.testing.assert_close(out.loss, out.mlm_loss + out.sbo_loss)
    summed = model(ids, labels=labels, spans=spans, loss_reduction="sum")
    assert summed.loss is None and summed.sbo_targets == out.sbo_targets > 0
    torch.testing.assert_close(summed.sbo_loss / summed.sbo_targets, out.sbo_loss)
    with pytest.raises(ValueError, match=r"spans must be int64 \(batch, seqlen, 3\)"):
        model(ids, labels=labels, spans=spans[..., :2])


def test_spanbert_saves_an_mlm_transformers_loads_and_its_sbo_head_beside(tmp_path):
    transformers = pytest.importorskip("transformers")
    from roberta_fast.sbo import SBO_WEIGHTS, RobertaForSpanBERT

    model = tiny_spanbert()
    model.save_pretrained(tmp_path)
    assert (tmp_path / SBO_WEIGHTS).is_file()
    hf, info = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(4, 37, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, model.eval()(ids).logits, rtol=1e-5, atol=1e-6)
    again = RobertaForSpanBERT.from_pretrained(tmp_path, backend="reference")
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_a_head_saved_with_another_max_offset_loads_with_it(tmp_path):
    """from_pretrained builds the head with the max_offset of the sbo.safetensors it loads (it was
    built with the default and failed on the offset table's shape); asking for another is refused."""
    from roberta_fast.sbo import RobertaForSpanBERT

    model = tiny_spanbert(max_offset=20)
    model.save_pretrained(tmp_path)
    again = RobertaForSpanBERT.from_pretrained(tmp_path, backend="reference")
    assert again.sbo.max_offset == 20
    assert torch.equal(again.sbo.offset_embeddings.weight, model.sbo.offset_embeddings.weight)
    assert RobertaForSpanBERT.from_pretrained(tmp_path, backend="reference", max_offset=20).sbo.max_offset == 20
    with pytest.raises(ValueError, match="max_offset=20, not the max_offset=10 asked for"):
        RobertaForSpanBERT.from_pretrained(tmp_path, backend="reference", max_offset=10)


def test_a_head_left_beside_another_model_is_named(tmp_path):
    """A RobertaForMaskedLM saved over a RobertaForSpanBERT's directory leaves the old sbo.safetensors:
    loading warns that the head was saved with other word embeddings (it paired them silently); the
    head's own model loads without a warning, in any dtype, and so does a file from before the record."""
    import roberta_fast as rf
    from safetensors.torch import load_file, save_file

    from roberta_fast.sbo import SBO_WEIGHTS, RobertaForSpanBERT

    spanbert = tiny_spanbert()
    spanbert.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RobertaForSpanBERT.from_pretrained(tmp_path, backend="reference")
        RobertaForSpanBERT.from_pretrained(tmp_path, backend="reference", dtype=torch.bfloat16)
    torch.manual_seed(1)
    rf.RobertaForMaskedLM(spanbert.config, backend="reference").save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="saved with other word embeddings than those of the model beside it"):
        stale = RobertaForSpanBERT.from_pretrained(tmp_path, backend="reference")
    assert torch.equal(stale.sbo.dense1.weight, spanbert.sbo.dense1.weight)  # loaded anyway

    save_file(load_file(tmp_path / SBO_WEIGHTS), tmp_path / SBO_WEIGHTS, metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RobertaForSpanBERT.from_pretrained(tmp_path, backend="reference")


def test_spanbert_save_pretrained_takes_transformers_keywords(tmp_path):
    """As every drop-in class: state_dict= is what is saved (the SBO head's entries too), max_shard_size
    shards, is_main_process=False writes nothing, what is not written is refused."""
    transformers = pytest.importorskip("transformers")
    from roberta_fast.sbo import SBO_WEIGHTS, RobertaForSpanBERT

    model = tiny_spanbert()
    model.save_pretrained(tmp_path / "none", is_main_process=False)
    assert not (tmp_path / "none").exists()
    state = {k: v + 0.5 for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "d", state_dict=state, max_shard_size="4KB")
    assert (tmp_path / "d" / "model.safetensors.index.json").is_file() and (tmp_path / "d" / SBO_WEIGHTS).is_file()
    transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "d")
    again = RobertaForSpanBERT.from_pretrained(tmp_path / "d", backend="reference").state_dict()
    for key, value in state.items():
        assert torch.equal(again[key], value), key
    with pytest.raises(ValueError, match="push_to_hub"):
        model.save_pretrained(tmp_path / "e", push_to_hub=True)


def test_a_state_dict_without_the_head_writes_no_sbo_file(tmp_path):
    """save_pretrained(state_dict=<no "sbo." keys>) wrote an empty sbo.safetensors that from_pretrained
    failed to load; now none is written (a stale one is removed), and an empty or partial file left by
    an older version loads as a missing one: the head newly initialised, with a warning naming the file."""
    from safetensors.torch import save_file

    from roberta_fast.sbo import SBO_WEIGHTS, RobertaForSpanBERT

    model = tiny_spanbert()
    model.save_pretrained(tmp_path)  # a head file, which the encoder-only save must remove
    encoder_only = {k: v for k, v in model.state_dict().items() if not k.startswith("sbo.")}
    model.save_pretrained(tmp_path, state_dict=encoder_only)
    assert not (tmp_path / SBO_WEIGHTS).exists()
    with pytest.warns(UserWarning, match=r"newly initialised.*'sbo\."):
        again = RobertaForSpanBERT.from_pretrained(tmp_path, backend="reference")
    assert torch.equal(again.roberta.embeddings.word_embeddings.weight, model.roberta.embeddings.word_embeddings.weight)
    head = {k[len("sbo."):]: v for k, v in model.state_dict().items() if k.startswith("sbo.")}
    for partial in ({}, {k: v for k, v in head.items() if k != "bias"}):
        save_file(partial, tmp_path / SBO_WEIGHTS, metadata={"format": "pt"})
        with pytest.warns(UserWarning, match=rf"newly initialised \(not in .*{SBO_WEIGHTS}\): \['sbo\.bias'"):
            RobertaForSpanBERT.from_pretrained(tmp_path, backend="reference")


def test_no_target_gives_a_zero_that_reaches_every_parameter():
    head = SpanBoundaryHead(RobertaConfig(vocab_size=37, hidden_size=16, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=32))
    labels = torch.full((2, 5), IGNORE)
    loss, count = head(torch.randn(2, 5, 16), labels, spans_of(labels), torch.randn(37, 16), backend="fused")
    loss.backward()
    assert count == 0 and loss.item() == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in head.parameters())


def test_a_pad_is_never_a_boundary_so_training_and_evaluation_agree():
    """A user-made row with padding right after its text (no `</s>`): the span before the pad
    has no right boundary, so the SBO never reads the pad's hidden state, which the
    no-grad unpadded path zeroes and the training path does not: both give one loss."""
    import roberta_fast as rf

    model = tiny_spanbert().eval()
    ids = torch.tensor([[0] + list(range(5, 15)) + [1] * 4, [0] + list(range(20, 33)) + [2]])
    mask = ids.ne(1).long()
    losses, targets = [], []
    for seed in range(4):
        _, labels, spans = rf.mask_tokens(ids, seed=seed, vocab_size=37, mlm_probability=0.6, strategy="span",
                                          word_starts=torch.ones_like(ids, dtype=torch.bool), return_spans=True)
        train = model(ids, labels=labels, spans=spans, attention_mask=mask).sbo_loss
        with torch.no_grad():
            evaluate = model(ids, labels=labels, spans=spans, attention_mask=mask)
        torch.testing.assert_close(evaluate.sbo_loss, train.detach())
        assert not spans[0, :, :2].eq(11).any(), spans[0]  # position 11: the first pad
        targets.append(evaluate.sbo_targets)
    assert sum(targets) > 0


def test_training_flops_count_the_span_boundary_head():
    """training_flops' matmul part (all but attention's 12·L·H·T per token) equals the Linear FLOPs
    torch's FLOP counter sees in a SpanBERT training step: encoder, MLM head and SBO head."""
    from torch.utils.flop_counter import FlopCounterMode

    import roberta_fast as rf
    from roberta_fast.model import training_flops

    model = tiny_spanbert().train()
    cfg = model.config
    ids = torch.randint(5, 37, (2, 16))
    _, labels, spans = rf.mask_tokens(ids, seed=0, vocab_size=37, mlm_probability=0.5, strategy="span",
                                      word_starts=torch.ones_like(ids, dtype=torch.bool), return_spans=True)
    with FlopCounterMode(display=False) as counter:
        out = model(ids, labels=labels, spans=spans, masked_only=True)
        (out.mlm_loss + out.sbo_loss).backward()
    linear = sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op).split(".")[1] in ("mm", "addmm"))
    predicted, sbo_predicted = int(labels.ne(-100).sum()), int(out.sbo_targets)
    assert 0 < sbo_predicted <= predicted
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * 16 * ids.numel()
    assert linear == training_flops(cfg, ids.numel(), predicted, 16, sbo_predicted) - attention
