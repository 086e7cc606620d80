"""Placeholder: the Triton attention kernel is being written (issue 3)."""


def attention(*args, **kwargs):
    raise NotImplementedError("roberta_fast.kernels.attention is not implemented yet (issue 3)")


def attention_ref(*args, **kwargs):
    raise NotImplementedError("roberta_fast.kernels.attention_ref is not implemented yet (issue 3)")
