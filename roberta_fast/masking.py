"""Dynamic MLM masking on the device that holds the batch: `mask_tokens`.

RoBERTa masks every sequence afresh each time it is seen (dynamic masking). Here
the mask of sample i at step s is a pure function of (seed, s, i, position)
through the counter-based Philox4x32-10 generator, so it is made where the ids
are (C++ on the CPU, CUDA on the GPU: roberta_fast._C, csrc/mask_math.h), needs
no data copies or host sync, is identical on CPU and GPU, identical after a
resume, and fresh at every step.

The rule (csrc/mask_math.h; `mask_tokens_ref` below is its NumPy twin, which the
tests hold the C++ and CUDA builds to, bit for bit):
- special ids, pad and <mask> are never selected ("maskable" = everything else);
- ``token``: each maskable token is selected when its draw is below
  mlm_probability (15%); ``whole_word``: the same per word, a word being a
  token marked in `word_starts` (byte-level BPE's 'Ġ') plus the tokens after it
  up to the next word start or special token; ``span`` (SpanBERT): spans of
  geometric(0.2) length in words, clipped at 10 (renormalised, mean ~3.8), at
  uniformly drawn anchor words, until mlm_probability of the maskable tokens is
  selected: marking stops at that budget, mid-word if need be (SpanBERT's
  PairWithSpanMaskingScheme.mask), so a long word cannot overshoot it;
- every row with a maskable token gets at least one prediction (the unit with
  the smallest draw, cut to the row's budget of max(1, ceil(mlm_probability *
  maskable tokens)) tokens, so a row that is one long word is not masked whole),
  so no batch has a zero denominator;
- selected tokens become <mask> (80%), a random non-special token (10%) or stay
  (10%); their labels are the original ids, all other labels -100. ``token`` and
  ``whole_word`` draw that decision per token; ``span`` draws it once per span
  (SpanBERT), a span being a maximal run of predicted tokens in a row: spans
  that overlap or touch are one span, as SpanBERT's merge_intervals makes them.
  The random id itself is drawn per token.
Draws: Philox4x32-10, key = seed (64 bits), counter = (position or iteration,
sample index, step, stream); see csrc/mask_math.h.

Span boundaries (`return_spans=True`, for the span boundary objective, roberta_fast.sbo):
for a predicted token j of the span [s, e] of its row, (s - 1, e + 1, j - s); -1 for a
boundary outside the row (s = 0, or e + 1 = seqlen: a row cut mid-text), all -1 for
tokens not predicted. Spans never contain a special token, so a boundary is the
nearest token not predicted: a word, or `<s>` / `</s>` at a text's edge, whose hidden
state the SBO head uses as it is. A pad is never a boundary (-1 instead, as outside the
row): its hidden state is meaningless, and zero on the unpadded inference path. (SpanBERT's span_masking instead drops the
pair targets of spans that touch its block's edges, so its [CLS]/[SEP] are never
boundaries; a head wanting that can drop targets whose boundary id is special.)
A span never crosses a document: roberta_fast.data ends every document with `</s>`,
which is never predicted, so at most that `</s>` is a boundary of the next document's
first span (FULL-SENTENCES, where attention crosses documents too). In packed
DOC-SENTENCES rows every run is `<s>` ... `</s>`, so both boundaries lie in the span's
own run, the attention segment of cu_seqlens (tests/test_mask_tokens.py checks this on
rows of the real PretrainingDataset); no document-start input is needed.
"""
import operator

import numpy as np
import torch

from . import _ext

STRATEGIES = {"token": 0, "whole_word": 1, "span": 2}
IGNORE_INDEX = -100
_MAX_SPAN_WORDS = 10
_TWO32 = 1 << 32


def mask_tokens(input_ids, *, seed=0, step=0, vocab_size=50265, mask_token_id=None,
                pad_token_id=1, special_token_ids=(0, 1, 2, 3), mlm_probability=0.15,
                mask_replace_prob=0.8, random_replace_prob=0.1, strategy="token",
                word_starts=None, sample_offset=0, return_spans=False):
    """Mask a batch for MLM on its own device; returns ``(masked_ids, labels)``, or
    ``(masked_ids, labels, spans)`` with return_spans.

    input_ids: (batch, seqlen) int64 (int32 accepted), contiguous, any device.
    seed, step: the mask is a function of (seed, step, sample index, position).
    sample_offset: global index of row 0, so that under gradient accumulation or
        data parallelism a sample's mask depends on its global index, not on the
        rank or micro-batch it landed in.
    vocab_size, mask_token_id (default vocab_size - 1, roberta-base's <mask>),
    pad_token_id, special_token_ids: the tokenizer's ids; these are never
        selected and never drawn as random replacements.
    mlm_probability, mask_replace_prob, random_replace_prob: 15% selected, of
        those 80% <mask>, 10% random, the rest unchanged.
    strategy: "token" | "whole_word" | "span"; the last two need word_starts, a
        bool tensor shaped like input_ids, True where a token starts a word. "span"
        decides <mask> / random / unchanged once per span (maximal run of predicted
        tokens), the others per token.
    return_spans: also return `spans`, (batch, seqlen, 3) int64: for a predicted
        token j of the span [s, e] of its row (s - 1, e + 1, j - s), the positions
        in the row of the tokens just before and just after its span (-1 when that
        is outside the row or a pad) and j's offset in it; (-1, -1, -1) where nothing is
        predicted. Meant for the span strategy and the SBO (see the module docstring
        for what the boundary tokens can be); defined for every strategy.
    Returns int64 tensors on input_ids' device: the masked ids and the labels
    (the original id where a prediction is made, -100 elsewhere). No host sync.
    Ids outside [0, vocab_size) raise ValueError on the CPU; on CUDA they are not
    checked (that would need a host sync).
    """
    a = _arguments(input_ids, seed, step, vocab_size, mask_token_id, pad_token_id,
                   special_token_ids, mlm_probability, mask_replace_prob,
                   random_replace_prob, strategy, word_starts, sample_offset)
    if a["ids"].numel() == 0:  # (0, S) or (B, 0): nothing to mask, whatever the strategy; the
        # extension would read the empty word_starts (a null data pointer) as a missing one
        a = {**a, "strategy": STRATEGIES["token"], "word_starts": None}
    result = _ext.load().mask_tokens(
        a["ids"], a["word_starts"], a["seed"] & 0xFFFFFFFF, a["seed"] >> 32, a["step"],
        a["sample_offset"], a["strategy"], a["mlm_probability"], a["mask_replace_prob"],
        a["random_replace_prob"], a["vocab_size"], a["mask_token_id"], a["special"],
        _flag("return_spans", return_spans))
    if len(result) == 3:
        result = (*result[:2], no_pad_boundaries(result[2], a["ids"], a["pad_token_id"]))
    return tuple(result)


def mask_tokens_ref(input_ids, *, return_spans=False, **kwargs):
    """Pure-Python/NumPy reference of `mask_tokens` (same arguments, same result,
    bit for bit); slow, for tests. Returns CPU int64 tensors."""
    a = _arguments(input_ids, **{**_DEFAULTS, **kwargs})
    ids = a["ids"].cpu().numpy()
    starts = None if a["word_starts"] is None else a["word_starts"].cpu().numpy()
    if ((ids < 0) | (ids >= a["vocab_size"])).any():
        raise ValueError(f"mask_tokens: input ids outside the vocabulary [0, {a['vocab_size']})")
    rule = _Rule(a)
    out, labels = np.empty_like(ids), np.empty_like(ids)
    spans = np.empty((*ids.shape, 3), dtype=np.int64)
    for r in range(ids.shape[0]):
        out[r], labels[r], spans[r] = rule.mask_row(
            ids[r], None if starts is None else starts[r], a["sample_offset"] + r)
    spans = no_pad_boundaries(torch.from_numpy(spans), a["ids"].cpu(), a["pad_token_id"])
    result = (torch.from_numpy(out), torch.from_numpy(labels), spans)
    return result if _flag("return_spans", return_spans) else result[:2]


def no_pad_boundaries(spans, ids, pad_token_id):
    """`spans` with a boundary that is a pad token set to -1, as one outside the row: a pad's
    hidden state means nothing (the unpadded inference path zeroes it, the padded one does
    not), so the SBO never reads it (a user-made row with no `</s>` before its padding)."""
    is_pad = ids.eq(pad_token_id)  # (batch, seqlen)
    bounds = spans[..., :2]  # (batch, seqlen, 2): left, right
    at_pad = bounds.ge(0) & is_pad.gather(1, bounds.clamp(min=0).flatten(1)).view_as(bounds)
    return torch.cat([bounds.masked_fill(at_pad, -1), spans[..., 2:]], dim=-1)


_DEFAULTS = dict(seed=0, step=0, vocab_size=50265, mask_token_id=None, pad_token_id=1,
                 special_token_ids=(0, 1, 2, 3), mlm_probability=0.15, mask_replace_prob=0.8,
                 random_replace_prob=0.1, strategy="token", word_starts=None, sample_offset=0)


def _int(name, value, low, high, hint=""):
    """value as an int in [low, high), else a TypeError/ValueError naming it."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"mask_tokens: {name} must be an int, got {type(value).__name__}") from None
    if not low <= v < high:
        raise ValueError(f"mask_tokens: {name}={v} must be in [{low}, {high}){hint}")
    return v


def _flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"mask_tokens: {name} must be True or False, got {value!r}")
    return value


def _prob(name, value):
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"mask_tokens: {name}={v} must be a probability in [0, 1]")
    return v


def _arguments(input_ids, seed, step, vocab_size, mask_token_id, pad_token_id,
               special_token_ids, mlm_probability, mask_replace_prob, random_replace_prob,
               strategy, word_starts, sample_offset):
    """Validates and normalises the arguments shared by mask_tokens and its reference."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"mask_tokens: input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"mask_tokens: input_ids must be int64 or int32, got {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"mask_tokens: input_ids must be (batch, seqlen), got shape "
                         f"{tuple(input_ids.shape)}; use input_ids[None] for one sequence")
    if not input_ids.is_contiguous():
        raise ValueError("mask_tokens: input_ids must be contiguous; call .contiguous() first")
    if strategy not in STRATEGIES:
        raise ValueError(f"mask_tokens: strategy={strategy!r}; use one of {sorted(STRATEGIES)}")
    if strategy != "token":
        if word_starts is None:
            raise ValueError(f"mask_tokens: strategy={strategy!r} needs word_starts, a bool "
                             "tensor shaped like input_ids, True where a word starts")
        if not isinstance(word_starts, torch.Tensor) or word_starts.dtype != torch.bool:
            raise TypeError("mask_tokens: word_starts must be a bool torch.Tensor")
        if word_starts.shape != input_ids.shape:
            raise ValueError(f"mask_tokens: word_starts has shape {tuple(word_starts.shape)}, "
                             f"input_ids {tuple(input_ids.shape)}")
        if word_starts.device != input_ids.device:
            raise ValueError(f"mask_tokens: word_starts is on {word_starts.device}, input_ids on "
                             f"{input_ids.device}; put them on one device")
        if not word_starts.is_contiguous():
            raise ValueError("mask_tokens: word_starts must be contiguous; call .contiguous() first")
    else:
        word_starts = None
    vocab_size = _int("vocab_size", vocab_size, 1, 1 << 62)
    if mask_token_id is None:
        mask_token_id = vocab_size - 1
    hint = f", the vocabulary of vocab_size={vocab_size}: does vocab_size match the tokenizer?"
    mask_token_id = _int("mask_token_id", mask_token_id, 0, vocab_size, hint)
    pad_token_id = _int("pad_token_id", pad_token_id, 0, vocab_size, hint)
    special = sorted({_int("a special token id", s, 0, vocab_size, hint) for s in special_token_ids}
                     | {pad_token_id, mask_token_id})
    if len(special) > 64:
        raise ValueError(f"mask_tokens: at most 64 special ids, got {len(special)}")
    if len(special) >= vocab_size:
        raise ValueError(f"mask_tokens: every id of the vocabulary (vocab_size={vocab_size}) "
                         "is special: no id is left for random replacements")
    mask_replace_prob = _prob("mask_replace_prob", mask_replace_prob)
    random_replace_prob = _prob("random_replace_prob", random_replace_prob)
    if mask_replace_prob + random_replace_prob > 1.0:
        raise ValueError("mask_tokens: mask_replace_prob + random_replace_prob must be at most 1")
    batch = input_ids.shape[0]
    sample_offset = _int("sample_offset", sample_offset, 0, _TWO32 - batch + 1)
    if input_ids.shape[1] >= _TWO32:
        raise ValueError("mask_tokens: seqlen must be below 2**32")
    return dict(
        ids=input_ids.long(), word_starts=word_starts, seed=_int("seed", seed, 0, 1 << 64),
        step=_int("step", step, 0, _TWO32), sample_offset=sample_offset,
        strategy=STRATEGIES[strategy], mlm_probability=_prob("mlm_probability", mlm_probability),
        mask_replace_prob=mask_replace_prob, random_replace_prob=random_replace_prob,
        vocab_size=vocab_size, mask_token_id=mask_token_id, pad_token_id=pad_token_id, special=special)


# ----------------------------------------------------------------------------
# NumPy reference of csrc/mask_math.h
# ----------------------------------------------------------------------------

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of counters (c0, c1, c2, c3) (broadcastable uint32 arrays or
    ints) with key (k0, k1); returns four uint32 arrays. Random123's algorithm."""
    c = [np.asarray(x, dtype=np.uint64) & _MASK32 for x in (c0, c1, c2, c3)]
    c = np.broadcast_arrays(*c)
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    for _ in range(10):
        p0 = np.uint64(_M0) * c[0]  # 32x32 -> 64 bits, exact in uint64
        p1 = np.uint64(_M1) * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
        k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return tuple(x.astype(np.uint32) for x in c)


def _threshold(prob):
    """floor(prob * 2^32) clamped to [0, 2^32], as probability_threshold in C++."""
    return min(max(int(np.floor(prob * 4294967296.0)), 0), _TWO32)


class _Rule:
    """The masking rule of csrc/mask_math.h, one row at a time."""

    def __init__(self, a):
        self.a = a
        self.special = np.array(a["special"], dtype=np.int64)
        self.num_regular = a["vocab_size"] - len(a["special"])
        self.select = _threshold(a["mlm_probability"])
        self.to_mask = _threshold(a["mask_replace_prob"])
        self.to_random = _threshold(a["mask_replace_prob"] + a["random_replace_prob"])
        q = [1.0]
        for _ in range(_MAX_SPAN_WORDS):
            q.append(q[-1] * 0.8)
        self.span_cdf = [_threshold((1.0 - q[l]) / (1.0 - q[_MAX_SPAN_WORDS]))
                         for l in range(1, _MAX_SPAN_WORDS)]

    def draw(self, a, sample, stream):
        seed = self.a["seed"]
        return philox4x32_10(a, sample, self.a["step"], stream, seed & 0xFFFFFFFF, seed >> 32)

    def mask_row(self, ids, starts, sample):
        n = len(ids)
        maskable = ~np.isin(ids, self.special)
        if self.a["strategy"] == STRATEGIES["token"]:
            unit_start = maskable
        else:
            prev = np.concatenate([[False], maskable[:-1]])
            unit_start = maskable & (starts | ~prev)
        labels = np.full(n, IGNORE_INDEX, dtype=np.int64)

        def select_unit(j, limit):  # the token or word starting at j, at most `limit` tokens of it
            count = 0
            while True:
                labels[j] = ids[j]
                count += 1
                j += 1
                if not (count < limit and j < n and self.a["strategy"] != 0 and maskable[j]
                        and not unit_start[j]):
                    return count

        if self.a["strategy"] == STRATEGIES["span"]:
            words = np.flatnonzero(unit_start)
            if len(words):
                u = int(self.draw(0, sample, 2)[0])
                budget = max((self.select * int(maskable.sum()) + u) >> 32, 1)
                selected = 0
                for it in range(10 * len(words) + 100):
                    if selected >= budget:
                        break
                    x, y, _, _ = (int(v) for v in self.draw(it, sample, 1))
                    span = 1
                    while span < _MAX_SPAN_WORDS and x >= self.span_cdf[span - 1]:
                        span += 1
                    anchor = (y * len(words)) >> 32
                    if labels[words[anchor]] != IGNORE_INDEX:
                        continue
                    for w in range(anchor, min(anchor + span, len(words))):
                        if selected >= budget:
                            break
                        if labels[words[w]] == IGNORE_INDEX:  # stops at the budget, even mid-word
                            selected += select_unit(words[w], budget - selected)
        else:
            x = self.draw(np.arange(n), sample, 0)[0].astype(np.int64)
            chosen = np.flatnonzero(unit_start & (x < self.select))
            for j in chosen:
                select_unit(j, n)
            candidates = np.flatnonzero(unit_start)
            if len(chosen) == 0 and len(candidates):  # the forced unit, cut to the row's budget
                budget = max((self.select * int(maskable.sum()) + _TWO32 - 1) >> 32, 1)
                select_unit(candidates[np.argmin(x[candidates])], budget)  # argmin: earliest on ties

        # Spans: maximal runs [s, e] of selected tokens; token j gets (s - 1, e + 1, j - s).
        sel = labels != IGNORE_INDEX
        start, end = np.arange(n), np.arange(n)
        for j in range(1, n):
            if sel[j] and sel[j - 1]:
                start[j] = start[j - 1]
        for j in range(n - 2, -1, -1):
            if sel[j] and sel[j + 1]:
                end[j] = end[j + 1]
        spans = np.stack([start - 1, np.where(end + 1 < n, end + 1, -1), np.arange(n) - start], 1)
        spans[~sel] = -1

        _, y, z, _ = self.draw(np.arange(n), sample, 0)
        y, z = y.astype(np.int64), z.astype(np.uint64)
        if self.a["strategy"] == STRATEGIES["span"]:
            y = y[start]  # one decision per span: the y drawn at its first position
        random_ids = ((z * np.uint64(self.num_regular)) >> np.uint64(32)).astype(np.int64)
        for s in self.special:  # the r-th regular id: step over the special ids, in order
            random_ids += random_ids >= s
        out = ids.copy()
        out[sel & (y < self.to_mask)] = self.a["mask_token_id"]
        rand = sel & (y >= self.to_mask) & (y < self.to_random)
        out[rand] = random_ids[rand]
        return out, labels, spans
