"""SpanBERT's span boundary objective (Joshi et al. 2019, section 3.2): `SpanBoundaryHead`.

For a predicted token i in a masked span (s..e), the head predicts token i from the two
tokens just outside the span and i's offset inside it:

    h_i = [x_{s-1}; x_{e+1}; p_{i-s}]                   (3 * hidden)
    y_i = LN2(GELU(W2 LN1(GELU(W1 h_i + b1)) + b2))     (hidden)
    logits_i = y_i E^T + b                              (E: the tied word embeddings)

and the SBO loss is the cross-entropy of those logits, averaged over the tokens it
predicts. The spans and their boundaries come from `mask_tokens(..., return_spans=True)`
(a span is a maximal run of predicted tokens, SpanBERT's merged intervals). A boundary
may be `<s>` or `</s>`, whose hidden state the head reads as it is, never a pad (masking
marks it -1). A span that touches the row's end or a pad has no right boundary (-1) and,
like a span longer than `max_offset` tokens beyond that offset, is left to the MLM loss
alone (SpanBERT's
released code also drops pair targets at the sequence edges and keeps 15 per span).
The offset embedding is hidden-sized so f's input is 3 * hidden, as in the paper's
formula (the released code used 200 dimensions).

`RobertaForSpanBERT` is RobertaForMaskedLM with this head beside the MLM head (loss =
MLM + SBO, each a mean over its predicted tokens); `python -m roberta_fast.train
--objective mlm+sbo` trains it. It saves the encoder and MLM head as a transformers
RobertaForMaskedLM directory and the SBO head beside it as `sbo.safetensors`, which records
the max_offset and a fingerprint of the word embeddings it was trained with, so loading it
beside another model (saved to the directory later) is reported.

The fused backend runs the head through the Triton bias+GELU, LayerNorm and
cross-entropy kernels (roberta_fast.ops), over the predicted tokens only;
`span_boundary_loss_ref` is the plain-PyTorch reference written from the formula.
"""
from __future__ import annotations

import hashlib
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from . import hub, ops
from .config import RobertaConfig
from .hf import _DOWNLOAD_KWARGS
from .model import ModelOutput, RobertaForMaskedLM, _output, check_inputs

SBO_WEIGHTS = "sbo.safetensors"
_WORDS = "roberta.embeddings.word_embeddings.weight"
_FINGERPRINT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes a model is loaded in

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

    def target_mask(self, labels, spans):
        """(batch, seqlen) bool: the tokens the SBO predicts: labelled, with both boundaries
        inside the row, at an offset below max_offset."""
        left, right, offset = spans.unbind(-1)  # each (batch, seqlen)
        return labels.ne(IGNORE_INDEX) & left.ge(0) & right.ge(0) & offset.lt(self.max_offset)

    def targets(self, labels, spans):
        """Flat indices (into batch*seqlen) of target_mask's tokens. One host sync."""
        return self.target_mask(labels, spans).reshape(-1).nonzero().squeeze(1)  # (num_targets,)

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
        if index.numel() == 0:  # nothing to predict: a zero that still reaches every parameter (DDP)
            return sum(p.sum() for p in self.parameters()).float() * 0.0, 0
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


@_output
class SpanBertOutput(ModelOutput):
    loss: torch.Tensor | None = None  # mlm_loss + sbo_loss ("mean"); None with "sum" (normalise each yourself)
    mlm_loss: torch.Tensor | None = None
    sbo_loss: torch.Tensor | None = None
    sbo_targets: int | None = None  # tokens the SBO predicted (the MLM predicts every labelled one)
    logits: torch.Tensor | None = None  # MLM logits, (num_predicted, vocab)


class RobertaForSpanBERT(RobertaForMaskedLM):
    """RobertaForMaskedLM + SpanBoundaryHead `sbo`: SpanBERT's pretraining model.

    forward(input_ids, labels, spans, ...) runs the encoder once and both heads over the
    predicted tokens only; without `spans` it is RobertaForMaskedLM's forward.
    """

    _vocab_bias_heads = ("lm_head", "sbo")  # resize_token_embeddings resizes both decoder biases

    def __init__(self, config: RobertaConfig, backend: str = "auto", max_offset: int = MAX_SPAN_OFFSET):
        super().__init__(config, backend=backend)
        self.sbo = SpanBoundaryHead(config, max_offset)
        self.sbo.apply(self._init_weights)
        nn.init.zeros_(self.sbo.bias)

    def forward(self, input_ids, labels=None, spans=None, attention_mask=None, position_ids=None,
                cu_seqlens=None, max_seqlen: int | None = None, loss_reduction: str = "mean", **mlm_kwargs):
        if spans is None:
            return super().forward(input_ids, attention_mask=attention_mask, labels=labels,
                                   position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                   loss_reduction=loss_reduction, **mlm_kwargs)
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if labels is None or labels.shape != input_ids.shape:
            raise ValueError(f"spans need labels shaped like input_ids {tuple(input_ids.shape)}")
        if spans.shape != (*input_ids.shape, 3) or spans.dtype != torch.int64 or spans.device != input_ids.device:
            raise ValueError(f"spans must be int64 (batch, seqlen, 3) on {input_ids.device}, as "
                             f"mask_tokens(..., return_spans=True) returns; got {spans.dtype} "
                             f"{tuple(spans.shape)} on {spans.device}")
        if self.check_inputs:
            check_inputs(self.config, input_ids, attention_mask, None, position_ids, cu_seqlens, labels,
                         max_seqlen=max_seqlen)
        # both heads' token indices before the encoder runs: their host syncs wait for the masking only
        predicted = labels.reshape(-1).ne(IGNORE_INDEX).nonzero().squeeze(1)  # (num_predicted,)
        sbo_index = self.sbo.targets(labels, spans)  # (num_sbo_targets,)
        x = self.roberta.encode(input_ids, attention_mask, position_ids=position_ids, cu_seqlens=cu_seqlens,
                                max_seqlen=max_seqlen).last_hidden_state  # (batch, seqlen, H)
        backend = self._backend_for(input_ids)
        decoder = self.roberta.embeddings.word_embeddings.weight
        logits = self.lm_head(x.reshape(-1, x.shape[-1]).index_select(0, predicted), decoder, backend)
        mlm_loss = ops.cross_entropy(logits, labels.reshape(-1).index_select(0, predicted), loss_reduction,
                                     backend)
        sbo_loss, sbo_targets = self.sbo(x, labels, spans, decoder, backend, loss_reduction, index=sbo_index)
        loss = mlm_loss + sbo_loss if loss_reduction == "mean" else None
        return SpanBertOutput(loss, mlm_loss, sbo_loss, sbo_targets, logits)

    def _write_pretrained(self, directory, state_dict: dict | None, max_shard_size: int | str):
        """save_pretrained (transformers' keywords, as every drop-in class): the encoder and MLM head
        as a transformers RobertaForMaskedLM directory, the SBO head beside it as sbo.safetensors
        (its parameter names without the "sbo." prefix); a state_dict without "sbo." entries writes
        none (an empty file is no head) and removes one left from an earlier save."""
        from safetensors.torch import save_file

        from .files import atomic_path
        from .hf import save_pretrained

        save_pretrained(self, directory, exclude_prefix="sbo.", architecture="RobertaForMaskedLM",
                        state_dict=state_dict, max_shard_size=max_shard_size)
        state = self.state_dict() if state_dict is None else state_dict
        sbo = {k[len("sbo."):]: v.detach().cpu().contiguous() for k, v in state.items() if k.startswith("sbo.")}
        if not sbo:
            if os.path.isfile(os.path.join(directory, SBO_WEIGHTS)):  # stale: it belongs to another model
                os.remove(os.path.join(directory, SBO_WEIGHTS))
            return
        metadata = {"format": "pt", "max_offset": str(self.sbo.max_offset)}
        if state.get(_WORDS) is not None:
            metadata.update(encoder_fingerprints(state[_WORDS]))
        with atomic_path(os.path.join(directory, SBO_WEIGHTS)) as tmp:
            save_file(sbo, tmp, metadata=metadata)

    @classmethod
    def from_pretrained(cls, path, backend: str = "auto", **kwargs):
        """An HF MLM directory, Hub name (`revision` and the Hub options as for RobertaForMaskedLM) or
        transformers model; the SBO head from the directory's or repository's sbo.safetensors when it
        has one (built with the max_offset it was saved with), else newly initialised, with a warning;
        an empty or partial sbo.safetensors counts as none (the warning names it).

        sbo.safetensors records the word embeddings it was saved with (encoder_fingerprints); a head
        saved beside other ones (another model saved to the directory later) is loaded anyway, with
        a warning saying so. Files without that record load unchecked."""
        weights = ""
        if isinstance(path, (str, os.PathLike)):  # a Hub name: its download, with sbo.safetensors if any
            download = {name: kwargs[name] for name in _DOWNLOAD_KWARGS if name in kwargs}
            path = hub.model_dir(path, kwargs.get("revision"), **download)
            weights = os.path.join(path, SBO_WEIGHTS)
        if not os.path.isfile(weights):
            return super().from_pretrained(path, backend=backend, **kwargs)  # warns: sbo newly initialised
        from safetensors import safe_open
        from safetensors.torch import load_file

        head = load_file(weights)
        with safe_open(weights, framework="pt") as f:
            metadata = f.metadata() or {}
        offsets = head.get("offset_embeddings.weight")
        if offsets is not None:  # the head's max_offset is its offset table's length
            saved = offsets.shape[0]
            if kwargs.setdefault("max_offset", saved) != saved:
                raise ValueError(f"{weights} holds an SBO head with max_offset={saved}, not the "
                                 f"max_offset={kwargs['max_offset']} asked for; leave max_offset out to load "
                                 f"it, or move {SBO_WEIGHTS} away to start a new head")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"newly initialised.*'sbo\.")
            model = super().from_pretrained(path, backend=backend, **kwargs)
        missing = sorted(f"sbo.{k}" for k in model.sbo.state_dict().keys() - head.keys())
        if missing:  # an empty or partial file (saved from a state_dict without the head): as none
            warnings.warn(f"newly initialised (not in {weights}): {missing}", stacklevel=2)
            return model
        model.sbo.load_state_dict(head)
        words = model.roberta.embeddings.word_embeddings.weight
        loaded = encoder_fingerprints(words, (words.dtype,))  # files from before the record: no check
        if any(metadata.get(key, fingerprint) != fingerprint for key, fingerprint in loaded.items()):
            warnings.warn(f"{weights} was saved with other word embeddings than those of the model beside it "
                          "(was another model saved to the directory after the SBO head?): the head is loaded "
                          f"anyway; re-save the RobertaForSpanBERT to pair them, or move {SBO_WEIGHTS} away to "
                          "start a new head", stacklevel=2)
        return model


def encoder_fingerprints(word_embeddings: torch.Tensor, dtypes=_FINGERPRINT_DTYPES) -> dict:
    """{"encoder_sha256_<dtype>": sha256 of the word embeddings cast to dtype}, recorded in sbo.safetensors
    so that loading can tell a head from the model beside it from a stale one; one per dtype, as the
    model may be saved in one and loaded in another (casting is deterministic, so the load's matches)."""
    out = {}
    for dtype in dtypes:
        if dtype in _FINGERPRINT_DTYPES:
            data = word_embeddings.detach().to("cpu", dtype).contiguous().view(torch.uint8).numpy()
            out[f"encoder_sha256_{str(dtype).removeprefix('torch.')}"] = hashlib.sha256(data).hexdigest()
    return out


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
