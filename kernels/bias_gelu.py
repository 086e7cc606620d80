"""Placeholder: the Triton bias_gelu kernel is being written (issue 3)."""


def bias_gelu(*args, **kwargs):
    raise NotImplementedError("roberta_fast.kernels.bias_gelu is not implemented yet (issue 3)")


def bias_gelu_ref(*args, **kwargs):
    raise NotImplementedError("roberta_fast.kernels.bias_gelu_ref is not implemented yet (issue 3)")
