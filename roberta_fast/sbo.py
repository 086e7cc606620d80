"""SpanBERT's span boundary objective (Joshi et al. 2019, section 3.2): `SpanBoundaryHead`.

For a predicted token i in a masked span (s..e), the head predicts token i from the two
tokens just outside the span and i's offset inside it:

    h_i = [x_{s-1}; x_{e+1}; p_{i-s}]                   (3 * hidden)
    y_i = LN2(GELU(W2 LN1(GELU(W1 h_i + b1)) + b2))     (hidden)
    logits_i = y_i E^T + b                              (E: the tied word embeddings)

and the SBO loss is the cross-entropy of those logits, averaged over the tokens it
predicts. The spans and their boundaries come from `mask_tokens(..., return_spans=True)`
(a span is a maximal run of predicted tokens, SpanBERT's merged intervals). A boundary
may be `<s>`, `</s>` or pad: the head reads its hidden state as it is. A span that
touches the row's end has no right boundary (-1) and, like a span longer than
`max_offset` tokens beyond that offset, is left to the MLM loss alone (SpanBERT's
released code also drops pair targets at the sequence edges and keeps 15 per span).
The offset embedding is hidden-sized so f's input is 3 * hidden, as in the paper's
formula (the released code used 200 dimensions).

The fused backend runs the head through the Triton bias+GELU, LayerNorm and
cross-entropy kernels (roberta_fast.ops), over the predicted tokens only;
`span_boundary_loss_ref` is the plain-PyTorch reference written from the formula.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .config import RobertaConfig

IGNORE_INDEX = -100
MAX_SPAN_OFFSET = 15  # offsets p_0 .. p_14 (SpanBERT's --max-pair-targets 15); tokens further in are MLM-only


class SpanBoundaryHead(nn.Module):
    """f(x_{s-1}, x_{e+1}, p_{i-s}): two Linear -> GELU -> LayerNorm layers, then the tied decoder."""

    def __init__(self, config: RobertaConfig, max_offset: int = MAX_SPAN_OFFSET):
        super().__init__()
        hidden = config.hidden_size
        self.offset_embeddings = nn.Embedding(max_offset, hidden)
        self.dense1 = nn.Linear(3 * hidden, hidden)
        self.layer_norm1 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.dense2 = nn.Linear(hidden, hidden)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    @property
    def max_offset(self) -> int:
        return self.offset_embeddings.num_embeddings

    def targets(self, labels, spans):
        """Flat indices (into batch*seqlen) of the tokens the SBO predicts: labelled, with
        both boundaries inside the row, at an offset below max_offset. One host sync."""
        left, right, offset = spans.unbind(-1)  # each (batch, seqlen)
        keep = labels.ne(IGNORE_INDEX) & left.ge(0) & right.ge(0) & offset.lt(self.max_offset)
        return keep.reshape(-1).nonzero().squeeze(1)  # (num_targets,)

    def forward(self, hidden, labels, spans, decoder_weight, backend: str = "reference",
                reduction: str = "mean", index=None):
        """SBO loss ("mean" or "sum" over the predicted tokens) and the number of them.

        hidden: (batch, seqlen, H) the encoder's output; labels: (batch, seqlen), -100 where
        nothing is predicted; spans: (batch, seqlen, 3) int64 (left, right, offset) from
        mask_tokens(return_spans=True); index: `targets(labels, spans)` if already computed.
        """
        batch, seqlen, width = hidden.shape
        if index is None:
            index = self.targets(labels, spans)
        flat = hidden.reshape(-1, width)  # (batch*seqlen, H)
        picked = spans.reshape(-1, 3).index_select(0, index)  # (n, 3): left, right, offset
        row_start = torch.div(index, seqlen, rounding_mode="floor") * seqlen
        left = flat.index_select(0, row_start + picked[:, 0])  # (n, H)
        right = flat.index_select(0, row_start + picked[:, 1])
        position = self.offset_embeddings(picked[:, 2]).to(left.dtype)
        x = torch.cat([left, right, position], dim=-1)  # (n, 3H)
        x = ops.linear_gelu(x, self.dense1.weight, self.dense1.bias, backend)
        x = ops.dropout_add_layer_norm(x, None, self.layer_norm1.weight, self.layer_norm1.bias,
                                       self.layer_norm1.eps, 0.0, backend)
        x = ops.linear_gelu(x, self.dense2.weight, self.dense2.bias, backend)
        x = ops.dropout_add_layer_norm(x, None, self.layer_norm2.weight, self.layer_norm2.bias,
                                       self.layer_norm2.eps, 0.0, backend)
        logits = F.linear(x, decoder_weight, self.bias)  # (n, vocab)
        target = labels.reshape(-1).index_select(0, index)
        return ops.cross_entropy(logits, target, reduction, backend), index.numel()


def span_boundary_loss_ref(head: SpanBoundaryHead, hidden, labels, spans, decoder_weight):
    """The mean SBO loss, token by token from the formula in plain PyTorch (for tests)."""
    losses = []
    for b in range(hidden.shape[0]):
        for i in range(hidden.shape[1]):
            s_minus_1, e_plus_1, offset = (int(v) for v in spans[b, i])
            if labels[b, i] == IGNORE_INDEX or s_minus_1 < 0 or e_plus_1 < 0 or offset >= head.max_offset:
                continue
            h = torch.cat([hidden[b, s_minus_1], hidden[b, e_plus_1], head.offset_embeddings.weight[offset]])
            y = F.layer_norm(F.gelu(h @ head.dense1.weight.T + head.dense1.bias), (head.dense1.out_features,),
                             head.layer_norm1.weight, head.layer_norm1.bias, head.layer_norm1.eps)
            y = F.layer_norm(F.gelu(y @ head.dense2.weight.T + head.dense2.bias), (head.dense2.out_features,),
                             head.layer_norm2.weight, head.layer_norm2.bias, head.layer_norm2.eps)
            logits = y @ decoder_weight.T + head.bias
            losses.append(torch.logsumexp(logits.float(), 0) - logits[labels[b, i]].float())
    return torch.stack(losses).mean()
