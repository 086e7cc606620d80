"""roberta_fast.mask_tokens against its NumPy Philox reference, bit for bit.

Covers: Philox4x32-10 known-answer vectors (NumPy and C++), exact equality of the
C++ (and, on a GPU, CUDA) op with mask_tokens_ref for every strategy on awkward
shapes, CPU == GPU, rates on a large batch, special/pad never touched, at least
one prediction per row, determinism and freshness, sample_offset semantics, and
clear errors on bad input.
"""
import numpy as np
import pytest
import torch

import roberta_fast as rf
from roberta_fast import _ext
from roberta_fast.masking import mask_tokens_ref, philox4x32_10

VOCAB = 1000
SPECIAL = (0, 1, 2, 3)
MASK_ID = VOCAB - 1

# Random123's published known-answer vectors for Philox4x32-10: (counter, key, result).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def batch(rows, seqlen, seed=0, vocab=VOCAB):
    """Ids like a packed RoBERTa batch: <s> ... </s> with </s> inside, right padding,
    and a fully padded row; plus word starts ('Ġ') on ~60% of the tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab - 1, (rows, seqlen), generator=g)
    ids[:, 0] = 0
    if seqlen > 2:
        ids[:, seqlen // 2] = 2
    for r in range(rows):
        n = int(torch.randint(1, seqlen + 1, (1,), generator=g))
        ids[r, n - 1] = 2
        ids[r, n:] = 1
    if rows > 2:
        ids[rows - 1] = 1
    starts = torch.rand(rows, seqlen, generator=g) < 0.6
    return ids, starts


@pytest.mark.parametrize("counter, key, expected", KAT)
def test_philox_known_answers(counter, key, expected):
    got = philox4x32_10(*counter, *key)
    assert tuple(int(x) for x in got) == expected
    c = _ext.load().philox4x32(torch.tensor([counter], dtype=torch.int64), *key)
    assert tuple(c[0].tolist()) == expected


STRATEGIES = ["token", "whole_word", "span"]
OPTIONS = [
    dict(),
    dict(seed=2**40 + 7, step=123456, sample_offset=1000),
    dict(mlm_probability=0.5, mask_replace_prob=0.3, random_replace_prob=0.5, step=3),
    dict(mlm_probability=0.0),   # only the one forced prediction per row
    dict(mlm_probability=1.0, mask_replace_prob=0.0, random_replace_prob=1.0),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 37), (2, 130)])
def test_matches_reference(device, strategy, shape):
    ids, starts = batch(*shape, seed=shape[1])
    for kw in OPTIONS:
        kw = dict(vocab_size=VOCAB, strategy=strategy, word_starts=starts, **kw)
        want = mask_tokens_ref(ids, **kw)
        got = rf.mask_tokens(ids.to(device), **{**kw, "word_starts": starts.to(device)})
        for g, w in zip(got, want):
            assert g.device.type == device.type and g.dtype == torch.int64
            assert torch.equal(g.cpu(), w), (strategy, shape, kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cpu_equals_gpu_large(strategy):
    ids, starts = batch(64, 512, seed=1, vocab=50265)
    kw = dict(strategy=strategy, seed=5, step=9, sample_offset=77)
    cpu = rf.mask_tokens(ids, word_starts=starts, **kw)
    gpu = rf.mask_tokens(ids.cuda(), word_starts=starts.cuda(), **kw)
    for c, g in zip(cpu, gpu):
        assert torch.equal(c, g.cpu())


def test_default_arguments_and_int32(device):
    ids, _ = batch(4, 20, vocab=50265)
    out, labels = rf.mask_tokens(ids.to(device), seed=0, step=0)
    out32, labels32 = rf.mask_tokens(ids.to(device=device, dtype=torch.int32), seed=0, step=0)
    assert out32.dtype == torch.int64 and torch.equal(out, out32) and torch.equal(labels, labels32)
    want = mask_tokens_ref(ids)
    assert torch.equal(out.cpu(), want[0]) and torch.equal(labels.cpu(), want[1])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rates_and_invariants(device, strategy):
    ids, starts = batch(96, 512, seed=3, vocab=50265)
    out, labels = rf.mask_tokens(ids.to(device), seed=11, step=2, strategy=strategy,
                                 word_starts=starts.to(device))
    out, labels = out.cpu(), labels.cpu()
    special = torch.isin(ids, torch.tensor([0, 1, 2, 3, 50264]))
    selected = labels != -100
    # Special and pad tokens are never selected nor changed; unselected tokens unchanged.
    assert not (selected & special).any()
    assert torch.equal(out[~selected], ids[~selected])
    assert torch.equal(labels[selected], ids[selected])
    # Every row with a maskable token has a prediction; the padded row has none.
    has_maskable = (~special).any(1)
    assert torch.equal(selected.any(1), has_maskable)
    rate = selected.sum() / (~special).sum()
    assert abs(rate.item() - 0.15) < 0.01, rate
    masked = (out == 50264) & selected
    changed = (out != ids) & ~masked
    kept = selected & (out == ids)
    n = selected.sum().item()
    assert abs(masked.sum().item() / n - 0.8) < 0.02
    assert abs(kept.sum().item() / n - 0.1) < 0.02
    # Random replacements (a random draw may return the same id: counted as kept)
    assert abs((changed.sum().item() + kept.sum().item()) / n - 0.2) < 0.02
    assert not torch.isin(out[changed], torch.tensor([0, 1, 2, 3, 50264])).any()
    assert ((out >= 0) & (out < 50265)).all()
    if strategy != "token":
        # Whole words: a word's tokens are selected together.
        maskable = ~special
        prev = torch.cat([torch.zeros(ids.shape[0], 1, dtype=torch.bool), maskable[:, :-1]], 1)
        continuation = maskable & prev & ~starts
        cont_prev_selected = torch.cat([torch.zeros(ids.shape[0], 1, dtype=torch.bool),
                                        selected[:, :-1]], 1)
        assert torch.equal(selected[continuation], cont_prev_selected[continuation])


def test_span_lengths():
    """Span strategy: runs of selected words have SpanBERT's mean length (~3.8 words
    for isolated spans; merged neighbours make the observed runs a little longer)."""
    ids = torch.randint(4, 999, (64, 512))
    starts = torch.ones_like(ids, dtype=torch.bool)   # one token per word
    _, labels = rf.mask_tokens(ids, vocab_size=VOCAB, strategy="span", word_starts=starts,
                               seed=1)
    sel = (labels != -100).numpy()
    runs = []
    for row in sel:
        edges = np.diff(np.concatenate([[0], row.astype(np.int8), [0]]))
        runs += list(np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1))
    assert 3.3 < np.mean(runs) < 5.0 and max(runs) <= 30


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_at_least_one_prediction(device, strategy):
    """mlm_probability=0 still predicts one unit per row that has a maskable token."""
    ids, starts = batch(6, 9, seed=4)
    ids[2, 1:] = 1                      # a row with no maskable token
    _, labels = rf.mask_tokens(ids.to(device), vocab_size=VOCAB, mlm_probability=0.0,
                               strategy=strategy, word_starts=starts.to(device))
    per_row = (labels != -100).sum(1).cpu()
    maskable = ~torch.isin(ids, torch.tensor(SPECIAL + (MASK_ID,)))
    assert torch.equal(per_row > 0, maskable.any(1))
    if strategy == "token":
        assert per_row.max() == 1


def test_determinism_freshness_and_offset(device):
    ids, starts = batch(8, 64, seed=2)
    ids = ids.to(device)
    kw = dict(vocab_size=VOCAB, seed=3)
    a = rf.mask_tokens(ids, step=5, **kw)
    b = rf.mask_tokens(ids, step=5, **kw)
    c = rf.mask_tokens(ids, step=6, **kw)
    d = rf.mask_tokens(ids, step=5, vocab_size=VOCAB, seed=4)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    assert not torch.equal(a[1], c[1]) and not torch.equal(a[1], d[1])
    # A row's mask depends on its global index, not on the micro-batch it is in.
    tail = rf.mask_tokens(ids[3:].contiguous(), step=5, sample_offset=3, **kw)
    assert torch.equal(tail[1], a[1][3:]) and torch.equal(tail[0], a[0][3:])
    # The same sequence in two rows gets two different masks.
    twins = ids[1:2].repeat(2, 1)
    m = rf.mask_tokens(twins, step=5, **kw)[1]
    assert not torch.equal(m[0], m[1])


def test_bad_input():
    ids, starts = batch(2, 8)
    with pytest.raises(TypeError, match="int64 or int32"):
        rf.mask_tokens(ids.float())
    with pytest.raises(ValueError, match="batch, seqlen"):
        rf.mask_tokens(ids[0])
    with pytest.raises(ValueError, match="contiguous"):
        rf.mask_tokens(ids.t())
    with pytest.raises(ValueError, match="vocab"):
        rf.mask_tokens(ids, vocab_size=VOCAB, mask_token_id=VOCAB)
    with pytest.raises(ValueError, match="vocab"):
        rf.mask_tokens(ids, vocab_size=500)   # ids up to 998 do not fit: checked on the CPU
    with pytest.raises(ValueError, match="needs word_starts"):
        rf.mask_tokens(ids, vocab_size=VOCAB, strategy="span")
    with pytest.raises(ValueError, match="shape"):
        rf.mask_tokens(ids, vocab_size=VOCAB, strategy="whole_word", word_starts=starts[:, :4])
    with pytest.raises(TypeError, match="bool"):
        rf.mask_tokens(ids, vocab_size=VOCAB, strategy="whole_word", word_starts=starts.long())
    with pytest.raises(ValueError, match="strategy"):
        rf.mask_tokens(ids, vocab_size=VOCAB, strategy="wwm")
    with pytest.raises(ValueError, match="probability"):
        rf.mask_tokens(ids, vocab_size=VOCAB, mlm_probability=1.5)
    with pytest.raises(ValueError, match="at most 1"):
        rf.mask_tokens(ids, vocab_size=VOCAB, mask_replace_prob=0.8, random_replace_prob=0.3)
    with pytest.raises(ValueError, match="step"):
        rf.mask_tokens(ids, vocab_size=VOCAB, step=-1)
    with pytest.raises(TypeError, match="seed"):
        rf.mask_tokens(ids, vocab_size=VOCAB, seed=1.5)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="device"):
            rf.mask_tokens(ids.cuda(), vocab_size=VOCAB, strategy="span", word_starts=starts)
