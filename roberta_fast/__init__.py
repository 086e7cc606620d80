"""roberta_fast: fast RoBERTa pretraining and a drop-in fast encoder.

    import roberta_fast as rf
    cfg = rf.RobertaConfig.preset("base")
    mlm = rf.RobertaForMaskedLM(cfg)                  # backend="auto" | "fused" | "reference"
    mlm = rf.RobertaForMaskedLM.from_pretrained(path) # an HF model directory or a transformers model

Names are imported lazily so that `import roberta_fast` stays cheap and a missing
optional part (the compiled extension, triton) fails only where it is used.
"""
from importlib import import_module

__version__ = "0.1.0"

# public name -> submodule that defines it
_LAZY = {
    "RobertaConfig": "config",
    "RobertaModel": "model",
    "RobertaForMaskedLM": "model",
    "RobertaForSequenceClassification": "model",
    "RobertaForTokenClassification": "model",
    "RobertaForQuestionAnswering": "model",
    "RobertaForMultipleChoice": "model",
    "RobertaForSpanBERT": "sbo",
    "RobertaTokenizer": "tokenizer",
    "mask_tokens": "masking",
    "FusedAdam": "optim",
    "patch": "hf_patch",
    "prepack": "prepacked",
    "quantize": "quantization",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'roberta_fast' has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
