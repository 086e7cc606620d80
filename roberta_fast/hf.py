"""Hugging Face interop: the one place where HF weight names and layouts are converted.

HF's RoBERTa keeps query/key/value as three Linear layers and the MLM decoder as a
(tied) Linear; roberta_fast fuses Q/K/V into one (3·hidden, hidden) projection and
reads the decoder weight from the word embeddings. `hf_to_native` / `native_to_hf`
translate state dicts between the two; `load_pretrained` / `save_pretrained` move
whole checkpoints (config.json + model.safetensors, or pytorch_model.bin), from a
directory or a Hub name (roberta_fast.hub).
"""
from __future__ import annotations

import json
import os
import re
import warnings

import torch

from . import hub
from .config import RobertaConfig

# Native name suffix <-> HF name suffix, per encoder layer ({i} is the layer index).
_LAYER_RENAMES = {
    "attn_out": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "ffn_in": "intermediate.dense",
    "ffn_out": "output.dense",
    "ffn_norm": "output.LayerNorm",
}
_QKV = ("query", "key", "value")
_HEADS = ("lm_head.", "classifier.", "qa_outputs.", "sbo.")  # task heads: same names in HF and here
# HF keys that carry no weights of ours: buffers, and the decoder tied to the embeddings.
_HF_IGNORED = re.compile(r"(^|\.)embeddings\.(position_ids|token_type_ids)$|^lm_head\.decoder\.(weight|bias)$")


def _native_to_hf_key(key: str) -> str:
    """Rename one native key (the RobertaModel part, no prefix) to HF's name."""
    key = key.replace("embeddings.layer_norm.", "embeddings.LayerNorm.")
    match = re.match(r"layers\.(\d+)\.(\w+)\.(weight|bias)$", key)
    if match:
        i, name, kind = match.groups()
        return f"encoder.layer.{i}.{_LAYER_RENAMES[name]}.{kind}"
    if key.startswith("pooler."):
        return "pooler.dense." + key[len("pooler."):]
    return key


def native_to_hf(state_dict: dict, prefix: str = "") -> dict:
    """Native state dict -> HF names; `prefix` ("roberta.") marks where the encoder starts."""
    out = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):  # the MLM head keeps its name
            out[key] = value
            continue
        rest = key[len(prefix):]
        match = re.match(r"layers\.(\d+)\.qkv\.(weight|bias)$", rest)
        if match:
            i, kind = match.groups()
            for name, part in zip(_QKV, value.chunk(3, dim=0)):
                out[f"{prefix}encoder.layer.{i}.attention.self.{name}.{kind}"] = part.contiguous()
        else:
            out[prefix + _native_to_hf_key(rest)] = value
    return out


def hf_to_native(state_dict: dict, prefix: str = "") -> tuple[dict, list[str]]:
    """HF state dict -> native names. Returns (state dict, HF keys it did not recognise)."""
    hf_to_layer_name = {hf: native for native, hf in _LAYER_RENAMES.items()}
    out, unknown, qkv = {}, [], {}
    for key, value in state_dict.items():
        if _HF_IGNORED.search(key):
            continue
        if not key.startswith(prefix):
            if key.startswith(_HEADS):
                out[key] = value
            else:
                unknown.append(key)
            continue
        rest = key[len(prefix):]
        match = re.match(r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)$", rest)
        if match:
            i, name, kind = match.groups()
            qkv.setdefault((i, kind), {})[name] = value
            continue
        match = re.match(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$", rest)
        if match and match.group(2) in hf_to_layer_name:
            i, name, kind = match.groups()
            out[f"{prefix}layers.{i}.{hf_to_layer_name[name]}.{kind}"] = value
            continue
        if rest.startswith("embeddings."):
            out[prefix + rest.replace("embeddings.LayerNorm.", "embeddings.layer_norm.")] = value
        elif rest.startswith("pooler.dense."):
            out[prefix + "pooler." + rest[len("pooler.dense."):]] = value
        else:
            unknown.append(key)
    for (i, kind), parts in qkv.items():
        if set(parts) != set(_QKV):
            missing = sorted(set(_QKV) - set(parts))
            raise ValueError(f"checkpoint layer {i} has attention {sorted(parts)} {kind}s but lacks {missing}")
        out[f"{prefix}layers.{i}.qkv.{kind}"] = torch.cat([parts[n] for n in _QKV], dim=0)
    if "lm_head.bias" not in out and "lm_head.decoder.bias" in state_dict:
        out["lm_head.bias"] = state_dict["lm_head.decoder.bias"]  # older checkpoints keep only this
    return out, unknown


# ------------------------------------------------------------------ checkpoints
def read_hf_checkpoint(path_or_model, revision: str | None = None) -> tuple[RobertaConfig, dict]:
    """(config, HF-named state dict) from an HF model directory, a Hub name or a `transformers` model."""
    if isinstance(path_or_model, torch.nn.Module):
        hf_config = getattr(path_or_model, "config", None)
        if hf_config is None or not hasattr(hf_config, "to_dict"):
            raise ValueError("from_pretrained got a torch module without an HF `config`; pass a "
                             "transformers RoBERTa model or the path of an HF model directory")
        try:
            config = RobertaConfig.from_dict(hf_config.to_dict())
        except ValueError as err:
            raise ValueError(f"{type(path_or_model).__name__}'s config: {err}") from None
        state = {k: v.detach() for k, v in path_or_model.state_dict().items()}
        return config, state

    path = hub.model_dir(path_or_model, revision)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{path!r} is not a directory: from_pretrained takes an HF model directory (config.json "
            "plus model.safetensors or pytorch_model.bin), a Hugging Face Hub name such as "
            "'FacebookAI/roberta-base', or a transformers model object"
        )
    config = RobertaConfig.from_pretrained(path)
    return config, _read_weights(path)


def _read_weights(path: str) -> dict:
    from safetensors.torch import load_file

    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return load_file(single)
    for index_name, loader in (("model.safetensors.index.json", load_file),
                               ("pytorch_model.bin.index.json", _load_bin)):
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            state = {}
            for shard in shards:
                state.update(loader(os.path.join(path, shard)))
            return state
    binary = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(binary):
        return _load_bin(binary)
    raise FileNotFoundError(
        f"no weights in {path!r}: expected model.safetensors or pytorch_model.bin (or a sharded index)"
    )


def _load_bin(file: str) -> dict:
    return torch.load(file, map_location="cpu", weights_only=True)


def load_pretrained(cls, path_or_model, backend: str = "auto", dtype: torch.dtype | None = None,
                    device: str | torch.device | None = None, revision: str | None = None,
                    output_loading_info: bool = False, torch_dtype: torch.dtype | None = None,
                    ignore_mismatched_sizes: bool = False, **model_kwargs):
    """Build `cls` (RobertaModel or RobertaForMaskedLM) from an HF checkpoint: a directory,
    a Hub name (`revision` picks a branch, tag or commit) or a `transformers` model.

    Encoder weights must all be present; a head absent from the checkpoint (the pooler
    of an MLM checkpoint, the MLM head of a bare encoder) is initialised and reported,
    as transformers does. The model comes back in eval mode (dropout off), as transformers'
    from_pretrained returns it; call .train() to fine-tune. output_loading_info=True returns
    (model, {"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"}) as transformers
    does (native key names); torch_dtype is transformers' older name of dtype.
    ignore_mismatched_sizes=True initialises (and reports) the weights whose shape differs from
    the model's, as transformers does (a head loaded with another num_labels); without it they are refused.
    """
    dtype = dtype if dtype is not None else torch_dtype
    if isinstance(dtype, str):  # transformers' spellings: "float16", "torch.float16"; "auto" keeps fp32
        dtype = None if dtype == "auto" else getattr(torch, dtype.removeprefix("torch."))
    config, hf_state = read_hf_checkpoint(path_or_model, revision)
    model = cls(config, backend=backend, **model_kwargs)
    if any(p.is_meta for p in model.parameters()):
        raise RuntimeError("You are using `from_pretrained` with a meta device context manager (torch.device('meta')): "
                           "the weights would not be loaded; call from_pretrained outside it")
    prefix = "roberta." if hasattr(model, "roberta") else ""
    hf_state = _align_prefix(hf_state, prefix)
    if hasattr(model, "lm_head"):
        _refuse_untied_decoder(config, hf_state, prefix)
    state, unknown = hf_to_native(hf_state, prefix)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected)) + unknown
    head_prefixes = (prefix + "pooler.",) + _HEADS
    essential = [k for k in missing if not k.startswith(head_prefixes)]
    if essential:
        raise ValueError(f"checkpoint lacks encoder weights: {essential[:8]}{' ...' if len(essential) > 8 else ''}")
    mismatched = []
    for key in list(state):
        if key in expected and state[key].shape != expected[key].shape:
            if not ignore_mismatched_sizes:
                raise ValueError(f"checkpoint weight {key} has shape {tuple(state[key].shape)}, the config "
                                 f"implies {tuple(expected[key].shape)} (ignore_mismatched_sizes=True initialises "
                                 "it instead)")
            mismatched.append((key, tuple(state.pop(key).shape), tuple(expected[key].shape)))
    if mismatched:
        warnings.warn(f"newly initialised (shape differs from the checkpoint's): {mismatched}", stacklevel=3)
    if missing:
        warnings.warn(f"newly initialised (not in the checkpoint): {missing}", stacklevel=3)
    if unexpected:
        warnings.warn(f"checkpoint weights not used by {cls.__name__}: {unexpected}", stacklevel=3)
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    if dtype is not None or device is not None:
        model.to(device=device, dtype=dtype)
    model.eval()
    if output_loading_info:
        return model, {"missing_keys": set(missing), "unexpected_keys": set(unexpected),
                       "mismatched_keys": mismatched, "error_msgs": []}
    return model


def _refuse_untied_decoder(config, hf_state: dict, prefix: str) -> None:
    """The MLM decoder here *is* the word embeddings; a checkpoint whose decoder differs
    (tie_word_embeddings=false) would silently lose its trained decoder, so it is refused."""
    decoder = hf_state.get("lm_head.decoder.weight")
    embeddings = hf_state.get(prefix + "embeddings.word_embeddings.weight")
    differs = (decoder is not None and embeddings is not None
               and (decoder.shape != embeddings.shape or not torch.equal(decoder, embeddings)))
    if differs or getattr(config, "tie_word_embeddings", True) is False:
        raise ValueError(
            "this masked-LM checkpoint has an MLM decoder that is not its word embeddings "
            "(tie_word_embeddings=false); roberta_fast's RobertaForMaskedLM always ties them, so the "
            "trained decoder would be lost. Load it with transformers' RobertaForMaskedLM, or load the "
            "encoder alone with rf.RobertaModel.from_pretrained")


def _align_prefix(state: dict, prefix: str) -> dict:
    """Give encoder keys the prefix the target model uses ("roberta." for the MLM, none for the encoder)."""
    encoder = ("embeddings.", "encoder.", "pooler.")
    out = {}
    for key, value in state.items():
        if key.startswith("roberta."):
            bare = key[len("roberta."):]
        elif key.startswith(encoder):
            bare = key
        else:
            out[key] = value
            continue
        out[prefix + bare] = value
    return out


def save_pretrained(model, directory: str | os.PathLike, exclude_prefix: str | None = None,
                    architecture: str | None = None):
    """Write config.json and model.safetensors in HF's layout, each file atomically.

    exclude_prefix: parameters left out (a head transformers does not know, saved apart);
    architecture: the class name config.json gives (default: the model's)."""
    from safetensors.torch import save_file

    from .files import atomic_path
    from .quantization import refuse_quantized

    refuse_quantized(model, "save_pretrained")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    prefix = "roberta." if hasattr(model, "roberta") else ""
    state = model.state_dict()
    if exclude_prefix:
        state = {k: v for k, v in state.items() if not k.startswith(exclude_prefix)}
    hf_state = native_to_hf(state, prefix)
    hf_state = {k: v.detach().to("cpu").contiguous() for k, v in hf_state.items()}
    with atomic_path(os.path.join(directory, "model.safetensors")) as tmp:  # (save_file alone writes 0600)
        save_file(hf_state, tmp, metadata={"format": "pt"})
    model.config.save_pretrained(directory, architectures=[architecture or type(model).__name__])
