// The dynamic-masking rule of roberta_fast.mask_tokens, shared by the CPU
// (mask_tokens.cpp) and CUDA (mask_tokens_cuda.cu) builds and mirrored line by
// line by the NumPy reference in roberta_fast/masking.py. No torch headers.
//
// Every random number is Philox4x32-10 with key = seed and counter
// (a, sample index, step, stream):
//   stream 0, a = position:  x selects the token (token / whole_word), y picks
//                            <mask> / random / unchanged, z picks the random token;
//   stream 1, a = iteration: x the span length, y the anchor word (span);
//   stream 2, a = 0:         x rounds the span budget.
// Replacement: token and whole_word decide <mask> / random / unchanged per token
// (the y of the token's own position); span decides it once per span, a span being
// a maximal run of predicted tokens (SpanBERT's merged intervals): every token of
// the run uses the y of the run's first position. The random id is per token (z of
// its own position) in every strategy.
// All decisions compare 32-bit draws with integer thresholds, so every
// implementation makes exactly the same choices.
#pragma once

#include <stdint.h>

#include "philox.h"

namespace roberta_fast {

constexpr int kMaxSpecialIds = 64;   // special, pad and mask ids, sorted, unique
constexpr int kMaxSpanWords = 10;    // SpanBERT clips span lengths at 10 words
constexpr int64_t kIgnoreIndex = -100;

enum MaskStrategy : int32_t { kToken = 0, kWholeWord = 1, kSpan = 2 };

struct MaskParams {
  uint32_t key0, key1;          // the seed, low and high 32 bits
  uint32_t step;
  int32_t strategy;             // MaskStrategy
  uint64_t select_threshold;    // select when draw < floor(mlm_probability * 2^32)
  uint64_t mask_threshold;      // -> <mask> when draw < floor(mask_replace_prob * 2^32)
  uint64_t random_threshold;    // -> random when draw < floor((mask + random) * 2^32)
  int64_t vocab_size;
  int64_t mask_token_id;
  int64_t num_regular;          // vocab_size - num_special: ids a random draw may give
  int32_t num_special;
  int64_t special[kMaxSpecialIds];            // sorted ascending
  uint64_t span_cdf[kMaxSpanWords - 1];       // P(len <= l) * 2^32, l = 1..9
};

RF_HD Philox4 mask_draw(const MaskParams& p, uint32_t a, uint32_t sample, uint32_t stream) {
  return philox4x32_10(Philox4{a, sample, p.step, stream}, p.key0, p.key1);
}

// True for ids that may be predicted: not special, pad or mask.
RF_HD bool is_maskable(const MaskParams& p, int64_t id) {
  for (int i = 0; i < p.num_special; ++i)
    if (p.special[i] == id) return false;
  return true;
}

// The r-th id (0-based) of the vocabulary with the special ids removed.
RF_HD int64_t regular_token(const MaskParams& p, uint32_t u) {
  int64_t id = static_cast<int64_t>(draw_below(u, static_cast<uint64_t>(p.num_regular)));
  for (int i = 0; i < p.num_special; ++i)
    if (id >= p.special[i]) ++id;
  return id;
}

// Output id of the selected token at `pos` (80% <mask>, 10% random, 10% unchanged
// by default): the y draw at `decide` (pos itself, or its span's first position)
// picks which, the z draw at pos picks the random id.
RF_HD int64_t replace_token(const MaskParams& p, int64_t id, uint32_t pos, uint32_t decide,
                            uint32_t sample) {
  const Philox4 r = mask_draw(p, pos, sample, 0);
  const uint32_t y = decide == pos ? r.y : mask_draw(p, decide, sample, 0).y;
  if (y < p.mask_threshold) return p.mask_token_id;
  if (y < p.random_threshold) return regular_token(p, r.z);
  return id;
}

// The span entry (left, right, offset) of position j in the run [s, e] of predicted
// tokens of a row of `len`: the positions just before and just after the run (-1
// when outside the row) and j's offset in it. spans3 points at j's three int64s.
RF_HD void write_span(int64_t len, int64_t s, int64_t e, int64_t j, int64_t* spans3) {
  spans3[0] = s - 1;
  spans3[1] = e + 1 < len ? e + 1 : -1;
  spans3[2] = j - s;
}

// Spans of one row (len x 3 int64) from its labels: write_span for every predicted
// token, (-1, -1, -1) for the others. Runs never cross a special token: specials
// are never predicted.
RF_HD void write_row_spans(const int64_t* labels, int64_t len, int64_t* spans) {
  for (int64_t s = 0; s < len;) {
    if (labels[s] == kIgnoreIndex) {
      spans[3 * s] = spans[3 * s + 1] = spans[3 * s + 2] = -1;
      ++s;
      continue;
    }
    int64_t e = s;
    while (e + 1 < len && labels[e + 1] != kIgnoreIndex) ++e;
    for (int64_t j = s; j <= e; ++j) write_span(len, s, e, j, spans + 3 * j);
    s = e + 1;
  }
}

// Span length in words: geometric(p = 0.2) truncated to 1..10 (SpanBERT).
RF_HD int span_length(const MaskParams& p, uint32_t u) {
  int len = 1;
  while (len < kMaxSpanWords && u >= p.span_cdf[len - 1]) ++len;
  return len;
}

// Does position j start a selection unit? Token strategy: every maskable token.
// Otherwise a word: a maskable token marked as a word start, or one that follows
// a special/pad token (the first word of a text carries no 'Ġ').
RF_HD bool starts_unit(const MaskParams& p, const int64_t* ids, const bool* word_starts,
                       int64_t j) {
  if (!is_maskable(p, ids[j])) return false;
  if (p.strategy == kToken) return true;
  return word_starts[j] || j == 0 || !is_maskable(p, ids[j - 1]);
}

// Marks the unit (token or word) starting at j as selected: labels = original id,
// at most `limit` (>= 1) of its tokens, so a budget can end mid-word (a row that is
// one long word: CJK without word starts, a long URL). Returns the number marked.
RF_HD int64_t select_unit(const MaskParams& p, const int64_t* ids, const bool* word_starts,
                          int64_t len, int64_t j, int64_t limit, int64_t* labels) {
  int64_t n = 0;
  do {
    labels[j] = ids[j];
    ++n;
    ++j;
  } while (n < limit && j < len && p.strategy != kToken && is_maskable(p, ids[j]) &&
           !starts_unit(p, ids, word_starts, j));
  return n;
}

// Token and whole-word strategies: each unit is selected when the x draw at its
// first position is below the threshold; a row with maskable tokens and nothing
// selected gets the unit with the smallest draw (ties: the earliest), cut to the
// row's budget of max(1, ceil(threshold * maskable tokens / 2^32)) tokens, so a row
// that is one word is not masked whole.
RF_HD void select_units(const MaskParams& p, const int64_t* ids, const bool* word_starts,
                        int64_t len, uint32_t sample, int64_t* labels) {
  bool any = false;
  int64_t num_maskable = 0;
  uint64_t best = ~uint64_t(0);  // (draw << 32) | position of the smallest draw
  for (int64_t j = 0; j < len; ++j) {
    num_maskable += is_maskable(p, ids[j]) ? 1 : 0;
    if (!starts_unit(p, ids, word_starts, j)) continue;
    const uint32_t u = mask_draw(p, static_cast<uint32_t>(j), sample, 0).x;
    if (u < p.select_threshold) {
      select_unit(p, ids, word_starts, len, j, len, labels);
      any = true;
    }
    const uint64_t key = (static_cast<uint64_t>(u) << 32) | static_cast<uint64_t>(j);
    if (key < best) best = key;
  }
  if (!any && best != ~uint64_t(0)) {
    int64_t budget = static_cast<int64_t>(
        (p.select_threshold * static_cast<uint64_t>(num_maskable) + 0xFFFFFFFFu) >> 32);
    if (budget < 1) budget = 1;
    select_unit(p, ids, word_starts, len, static_cast<int64_t>(best & 0xFFFFFFFFu), budget,
                labels);
  }
}

// Span strategy (SpanBERT): draw a span length and an anchor word, select the
// span's words that are not yet selected, until the budget of
// round(mlm_probability * maskable tokens) (stochastically rounded, at least 1)
// is reached: marking stops at the budget, mid-word if need be, as SpanBERT's
// PairWithSpanMaskingScheme.mask does. Uses `scratch` (len entries) to list the
// word starts.
RF_HD void select_spans(const MaskParams& p, const int64_t* ids, const bool* word_starts,
                        int64_t len, uint32_t sample, int64_t* labels, int64_t* scratch) {
  int64_t num_words = 0, num_maskable = 0;
  for (int64_t j = 0; j < len; ++j) {
    num_maskable += is_maskable(p, ids[j]) ? 1 : 0;
    if (starts_unit(p, ids, word_starts, j)) scratch[num_words++] = j;
  }
  if (num_words == 0) return;
  const uint32_t u = mask_draw(p, 0, sample, 2).x;
  int64_t budget = static_cast<int64_t>(
      (p.select_threshold * static_cast<uint64_t>(num_maskable) + u) >> 32);
  if (budget < 1) budget = 1;
  const int64_t max_iterations = 10 * num_words + 100;  // ends even when p ~ 1
  int64_t selected = 0;
  for (int64_t it = 0; it < max_iterations && selected < budget; ++it) {
    const Philox4 r = mask_draw(p, static_cast<uint32_t>(it), sample, 1);
    const int span = span_length(p, r.x);
    const int64_t anchor =
        static_cast<int64_t>(draw_below(r.y, static_cast<uint64_t>(num_words)));
    if (labels[scratch[anchor]] != kIgnoreIndex) continue;  // anchor already taken
    for (int64_t w = anchor; w < anchor + span && w < num_words && selected < budget; ++w) {
      if (labels[scratch[w]] != kIgnoreIndex) continue;
      selected += select_unit(p, ids, word_starts, len, scratch[w], budget - selected, labels);
    }
  }
}

// Masks one row: labels = original id where selected, else -100; out = the
// replaced id where selected, else the original; spans (len x 3, may be null) =
// write_row_spans. `out` doubles as the scratch space of the span strategy before
// it is written.
RF_HD void mask_row(const MaskParams& p, const int64_t* ids, const bool* word_starts,
                    int64_t len, uint32_t sample, int64_t* out, int64_t* labels,
                    int64_t* spans) {
  for (int64_t j = 0; j < len; ++j) labels[j] = kIgnoreIndex;
  if (p.strategy == kSpan)
    select_spans(p, ids, word_starts, len, sample, labels, out);
  else
    select_units(p, ids, word_starts, len, sample, labels);
  int64_t start = 0;  // first position of the current run of selected tokens
  for (int64_t j = 0; j < len; ++j) {
    if (labels[j] == kIgnoreIndex) {
      out[j] = ids[j];
      continue;
    }
    if (j == 0 || labels[j - 1] == kIgnoreIndex) start = j;
    const int64_t decide = p.strategy == kSpan ? start : j;  // per span, else per token
    out[j] = replace_token(p, ids[j], static_cast<uint32_t>(j), static_cast<uint32_t>(decide),
                           sample);
  }
  if (spans) write_row_spans(labels, len, spans);
}

}  // namespace roberta_fast
