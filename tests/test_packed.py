"""Packed rows (DOC-SENTENCES packing): several documents per row, attention kept inside each.

Each document's outputs in a packed batch must equal those of the document run on its
own, with both backends (the fused one through variable-length attention).
"""
import pytest
import torch

import roberta_fast as rf

pytest.importorskip("triton")

PAD = 1
CONFIG = dict(vocab_size=57, hidden_size=32, num_hidden_layers=2, num_attention_heads=1,
              intermediate_size=48, max_position_embeddings=20)
SEQLEN = 16
ROWS = [[5, 7], [16], [3, 3, 3]]  # document lengths per row; the rest of a row is a padding tail


def packed_batch(seed=0):
    """(input_ids, position_ids, cu_seqlens, documents) with documents[i] = (row, start, ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(ROWS), SEQLEN), PAD)
    positions = torch.full((len(ROWS), SEQLEN), PAD)
    cu, documents = [0], []
    for r, lengths in enumerate(ROWS):
        start = 0
        for n in lengths:
            doc = torch.randint(3, CONFIG["vocab_size"], (n,), generator=g)
            ids[r, start:start + n] = doc
            positions[r, start:start + n] = PAD + 1 + torch.arange(n)
            documents.append((r, start, doc))
            start += n
            cu.append(r * SEQLEN + start)
        if start < SEQLEN:
            cu.append((r + 1) * SEQLEN)  # the padding tail: a segment of its own
    return ids, positions, torch.tensor(cu, dtype=torch.int32), documents


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_packed_documents_equal_separate_runs(backend):
    torch.manual_seed(0)
    model = rf.RobertaModel(rf.RobertaConfig(**CONFIG), backend=backend).eval()
    ids, positions, cu_seqlens, documents = packed_batch()
    packed = model(ids, position_ids=positions, cu_seqlens=cu_seqlens).last_hidden_state
    weight = torch.zeros_like(packed)  # a loss over the documents' outputs only, not the padding tails
    for row, start, doc in documents:
        weight[row, start:start + len(doc)] = torch.randn(len(doc), packed.shape[-1])
    (packed * weight).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = 0
    for row, start, doc in documents:
        alone = model(doc[None]).last_hidden_state[0]
        torch.testing.assert_close(packed[row, start:start + len(doc)], alone, rtol=1e-5, atol=1e-5)
        total = total + (alone * weight[row, start:start + len(doc)]).sum()
    total.backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_mlm_packed_loss_matches_separate_documents():
    torch.manual_seed(0)
    model = rf.RobertaForMaskedLM(rf.RobertaConfig(**CONFIG), backend="reference").eval()
    ids, positions, cu_seqlens, documents = packed_batch(seed=1)
    labels = torch.full_like(ids, -100)
    for row, start, doc in documents:
        labels[row, start] = doc[0]
    out = model(ids, labels=labels, position_ids=positions, cu_seqlens=cu_seqlens, masked_only=True,
                loss_reduction="sum")
    expected = sum(model(doc[None], labels=torch.cat([doc[:1], torch.full((len(doc) - 1,), -100)])[None],
                         loss_reduction="sum").loss for _, _, doc in documents)
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    (lambda b: {**b, "cu_seqlens": b["cu_seqlens"].long()}, "1-D int32"),
    (lambda b: {**b, "cu_seqlens": b["cu_seqlens"][:-1]}, "must rise from 0"),
    (lambda b: {**b, "cu_seqlens": torch.tensor([0, 20, 48], dtype=torch.int32)}, "crosses a row boundary"),
    (lambda b: {**b, "position_ids": None}, "need position_ids"),
    (lambda b: {**b, "attention_mask": torch.ones(3, SEQLEN)}, "either attention_mask or cu_seqlens"),
])
def test_bad_packing_is_refused(change, message):
    model = rf.RobertaModel(rf.RobertaConfig(**CONFIG), backend="reference")
    ids, positions, cu_seqlens, _ = packed_batch()
    batch = change({"position_ids": positions, "cu_seqlens": cu_seqlens})
    with pytest.raises(ValueError, match=message):
        model(ids, **batch)


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_max_seqlen_below_the_longest_segment_is_refused(backend):
    """The fused variable-length attention covers max_seqlen tokens of a segment: a smaller
    max_seqlen than the longest segment (16 here) is refused naming both; a larger one is harmless."""
    torch.manual_seed(0)
    model = rf.RobertaForMaskedLM(rf.RobertaConfig(**CONFIG), backend=backend).eval()
    ids, positions, cu_seqlens, _ = packed_batch()
    with pytest.raises(ValueError, match=r"max_seqlen=8 is less than the longest cu_seqlens segment \(16 tokens\)"):
        model(ids, position_ids=positions, cu_seqlens=cu_seqlens, max_seqlen=8)
    with pytest.raises(ValueError, match="max_seqlen=15"):
        model.roberta(ids, position_ids=positions, cu_seqlens=cu_seqlens, max_seqlen=15)
    from roberta_fast.sbo import RobertaForSpanBERT

    spanbert = RobertaForSpanBERT(rf.RobertaConfig(**CONFIG), backend=backend)
    no_spans = torch.full((*ids.shape, 3), -1, dtype=torch.long)
    with pytest.raises(ValueError, match="max_seqlen=8"):
        spanbert(ids, labels=ids, spans=no_spans, position_ids=positions, cu_seqlens=cu_seqlens, max_seqlen=8)
    with torch.no_grad():
        exact = model(ids, position_ids=positions, cu_seqlens=cu_seqlens, max_seqlen=16).logits
        larger = model(ids, position_ids=positions, cu_seqlens=cu_seqlens, max_seqlen=SEQLEN + 4).logits
    torch.testing.assert_close(larger, exact)
