"""Triton kernels of roberta_fast, importable as `roberta_fast.kernels`.

One kernel per file, each with a plain-PyTorch `*_ref` beside it. On a machine
without a GPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`,
set before triton is imported).

Run from the repository root (`python -m ...` puts it on sys.path), this folder is
also reachable as a top-level `kernels`, the name of Hugging Face's kernel-hub
package, which `transformers` probes for by importing it. Imported under any name
but `roberta_fast.kernels` it is an empty module: executing the kernel files a
second time would register the `roberta_fast::*` torch ops again and leave the
first registration's handles dangling (a crash at the next call).
"""
if __name__ == "roberta_fast.kernels":
    from .attention import SUPPORTED_HEAD_DIMS as ATTENTION_HEAD_DIMS
    from .attention import attention, attention_dropout_mask, attention_qkvpacked, attention_ref, attention_varlen
    from .bias_gelu import bias_gelu, bias_gelu_ref
    from .cross_entropy import cross_entropy, cross_entropy_ref
    from .layer_norm import layer_norm, layer_norm_ref

    __all__ = [
        "ATTENTION_HEAD_DIMS",
        "attention",
        "attention_dropout_mask",
        "attention_qkvpacked",
        "attention_varlen",
        "attention_ref",
        "bias_gelu",
        "bias_gelu_ref",
        "cross_entropy",
        "cross_entropy_ref",
        "layer_norm",
        "layer_norm_ref",
    ]
else:
    __all__ = []
