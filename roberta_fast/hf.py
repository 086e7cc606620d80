"""Hugging Face interop: the one place where HF weight names and layouts are converted.

HF's RoBERTa keeps query/key/value as three Linear layers and the MLM decoder as a
(tied) Linear; roberta_fast fuses Q/K/V into one (3·hidden, hidden) projection and
reads the decoder weight from the word embeddings. `hf_to_native` / `native_to_hf`
translate state dicts between the two; `load_pretrained` / `save_pretrained` move
whole checkpoints (config.json + model.safetensors, or pytorch_model.bin), from a
directory or a Hub name (roberta_fast.hub).
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import os
import re
import warnings

import torch

from . import hub
from .config import DECODER_SETTINGS, RobertaConfig, attn_implementation_error, untied_decoder_error
from .files import inside

# Native name suffix <-> HF name suffix, per encoder layer ({i} is the layer index).
_LAYER_RENAMES = {
    "attn_out": "attention.output.dense",
    "attn_LayerNorm": "attention.output.LayerNorm",
    "ffn_in": "intermediate.dense",
    "ffn_out": "output.dense",
    "ffn_LayerNorm": "output.LayerNorm",
}
_QKV = ("query", "key", "value")
_HEADS = ("lm_head.", "classifier.", "qa_outputs.", "sbo.")  # task heads: same names in HF and here
# a layer's native keys
_LAYER_KEY = re.compile(rf"encoder\.layer\.\d+\.(qkv|{'|'.join(_LAYER_RENAMES)})\.(weight|bias)")
# HF keys that carry no weights of ours: buffers, and the decoder tied to the embeddings.
WEIGHT_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # save_pretrained's shard file names
_HF_IGNORED = re.compile(r"(^|\.)embeddings\.(position_ids|token_type_ids)$|^lm_head\.decoder\.(weight|bias)$")


def _native_to_hf_key(key: str) -> str:
    """Rename one native key (the RobertaModel part, no prefix) to HF's name."""
    match = re.match(r"encoder\.layer\.(\d+)\.(\w+)\.(weight|bias)$", key)
    if match:
        i, name, kind = match.groups()
        return f"encoder.layer.{i}.{_LAYER_RENAMES[name]}.{kind}"
    return key


def _hf_names(key: str, prefix: str = "") -> list[str]:
    """HF's names of one native key: three (query, key, value) for a fused qkv, else one."""
    if not key.startswith(prefix):  # the MLM head keeps its name
        return [key]
    rest = key[len(prefix):]
    match = re.match(r"encoder\.layer\.(\d+)\.qkv\.(weight|bias)$", rest)
    if match:
        i, kind = match.groups()
        return [f"{prefix}encoder.layer.{i}.attention.self.{name}.{kind}" for name in _QKV]
    return [prefix + _native_to_hf_key(rest)]


def native_to_hf(state_dict: dict, prefix: str = "") -> dict:
    """Native state dict -> HF names; `prefix` ("roberta.") marks where the encoder starts. An encoder
    layer's key that is no Linear's or LayerNorm's weight or bias (e.g. rf.quantize's `weight_int8`)
    is refused: HF has no name for it, and passed through it would load as a missing weight."""
    out = {}
    for key, value in state_dict.items():
        rest = key[len(prefix):]
        if key.startswith(prefix) and rest.startswith("encoder.layer.") and not _LAYER_KEY.fullmatch(rest):
            raise ValueError(f"state_dict key {key!r} is not an encoder layer's weight or bias, so it has no HF "
                             "name (a quantized or packed model's state, or a pruned or parametrized layer's?): "
                             "save the fp32 model's state_dict (after a pruning: torch.nn.utils.prune.remove on "
                             "each pruned layer)")
        names = _hf_names(key, prefix)
        if len(names) == 1:
            out[names[0]] = value
        else:  # the fused qkv, split in three
            out.update({name: part.contiguous() for name, part in zip(names, value.chunk(len(names), dim=0))})
    return out


def hf_to_native(state_dict: dict, prefix: str = "") -> tuple[dict, list[str]]:
    """HF state dict -> native names. Returns (state dict, HF keys it did not recognise).

    Older layouts read as transformers reads them: LayerNorm `gamma` / `beta` (its legacy names),
    the MLM bias as `lm_head.decoder.bias` (which transformers' decoder computes with when both
    are present), and tied word embeddings kept only as `lm_head.decoder.weight` (as
    safetensors' save_model keeps a shared tensor under the name that sorts first)."""
    hf_to_layer_name = {hf: native for native, hf in _LAYER_RENAMES.items()}
    state_dict = {re.sub(r"((?:^|\.)LayerNorm)\.(gamma|beta)$",  # transformers renames these only
                         lambda m: f"{m.group(1)}.{'weight' if m.group(2) == 'gamma' else 'bias'}", key): value
                  for key, value in state_dict.items()}
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
            out[f"{prefix}encoder.layer.{i}.{hf_to_layer_name[name]}.{kind}"] = value
            continue
        if rest.startswith(("embeddings.", "pooler.dense.")):
            out[prefix + rest] = value
        else:
            unknown.append(key)
    for (i, kind), parts in qkv.items():
        if set(parts) != set(_QKV):
            missing = sorted(set(_QKV) - set(parts))
            raise ValueError(f"checkpoint layer {i} has attention {sorted(parts)} {kind}s but lacks {missing}")
        out[f"{prefix}encoder.layer.{i}.qkv.{kind}"] = torch.cat([parts[n] for n in _QKV], dim=0)
    if "lm_head.decoder.bias" in state_dict:
        out["lm_head.bias"] = state_dict["lm_head.decoder.bias"]  # the decoder's, as transformers computes
    words = f"{prefix}embeddings.word_embeddings.weight"
    if prefix and words not in out and "lm_head.decoder.weight" in state_dict:
        out[words] = state_dict["lm_head.decoder.weight"]  # tied: the one tensor under the decoder's name
    return out, unknown


# ------------------------------------------------------------------ checkpoints
class MismatchedSizes(ValueError):
    """A checkpoint weight whose shape differs from the model's (a head of another num_labels);
    `detail` names it, for callers that say their own fix (finetune's --reinit-head)."""

    def __init__(self, detail: str):
        super().__init__(f"{detail} (ignore_mismatched_sizes=True initialises it instead)")
        self.detail = detail


def read_hf_checkpoint(path_or_model, revision: str | None = None, **download) -> tuple[RobertaConfig, dict]:
    """(config, HF-named state dict) from an HF model directory, a Hub name or a `transformers` model;
    `download`: huggingface_hub's options for a Hub name (hub.model_dir)."""
    if isinstance(path_or_model, torch.nn.Module):
        _refuse_unconvertible_module(path_or_model)
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

    path = hub.model_dir(path_or_model, revision, **download)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{path!r} is not a directory: from_pretrained takes an HF model directory (config.json "
            "plus model.safetensors or pytorch_model.bin), a Hugging Face Hub name such as "
            "'FacebookAI/roberta-base', or a transformers model object"
        )
    config = RobertaConfig.from_pretrained(path)
    return config, _read_weights(path)


def _rf_quantized(model: torch.nn.Module) -> bool:
    """Whether rf.quantize packed this roberta_fast model's layers (int8 or fp16 weights; not rf.prepack's
    fp32 packing, whose state_dict and save_pretrained are the plain model's)."""
    from .quantization import Fp16WeightLinear, Int8Linear

    return any(isinstance(m, (Int8Linear, Fp16WeightLinear)) for m in model.modules())


def _refuse_unconvertible_module(module: torch.nn.Module):
    """Refuse, naming the fix, the modules from_pretrained would otherwise misread as a checkpoint lacking
    weights: a roberta_fast model (its names are not transformers'), one with PEFT adapters (the base
    weights under other names, the adapters' beside them) or one quantized by torch.ao.quantization
    (packed weights, not tensors)."""
    from .model import _PreTrained

    if isinstance(module, _PreTrained) and _rf_quantized(module):
        raise ValueError(f"from_pretrained got a roberta_fast model quantized by rf.quantize ({type(module).__name__}), "
                         "not a transformers one: copy it with copy.deepcopy(model), or from_pretrained the fp32 "
                         "model it came from and rf.quantize that (a quantized model's weights are not "
                         "transformers' format: it neither saves with save_pretrained nor loads into an fp32 model)")
    if isinstance(module, _PreTrained):
        raise ValueError(f"from_pretrained got a roberta_fast model ({type(module).__name__}), not a transformers "
                         "one: it is already a roberta_fast model; copy it with copy.deepcopy(model), load its "
                         "weights into a model of its class with load_state_dict(model.state_dict()), or, for "
                         "another class, save the fp32 model (model.save_pretrained(dir)) and from_pretrained(dir)")
    if hasattr(module, "peft_config") or any(hasattr(m, "base_layer") for m in module.modules()):
        raise ValueError("from_pretrained got a model with PEFT adapters (LoRA layers): merge them into the "
                         "weights first (a PeftModel's model.merge_and_unload()) and pass that transformers model")
    quantized = [name for name, m in module.named_modules()
                 if type(m).__module__.startswith(("torch.ao.nn.quantized", "torch.nn.quantized"))]
    if quantized:
        raise ValueError(f"from_pretrained got a model quantized by torch.ao.quantization (quantize_dynamic: "
                         f"{quantized[0]} holds packed weights, which roberta_fast cannot read back): load the "
                         f"fp32 transformers model, pass it to from_pretrained, then call rf.quantize(model)")


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
                # a received index naming "../x" or an absolute path would load a file from elsewhere; the
                # name is checked, not where a link leads (a Hub snapshot's shards link into its blob store)
                state.update(loader(str(inside(path, shard, f"the shard of {index_name}",
                                               "shard names must be files in the model's directory"))))
            return state
    binary = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(binary):
        return _load_bin(binary)
    raise FileNotFoundError(
        f"no weights in {path!r}: expected model.safetensors or pytorch_model.bin (or a sharded index)"
    )


def _load_bin(file: str) -> dict:
    """A pytorch_model.bin's tensors, with weights_only=True: a file holding other Python objects,
    which unpickling could run code from, is refused (torch's own message suggests turning
    weights_only off, which roberta_fast never does)."""
    import pickle

    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        lines = [line for line in str(err).splitlines() if "GLOBAL" in line or "global" in line]
        found = f" ({lines[0].strip()[:200]})" if lines else ""
        raise ValueError(
            f"refusing to load {file!r}: it holds Python objects beyond tensors and plain containers{found}, "
            "and unpickling them can run arbitrary code; roberta_fast never does (passing weights_only to "
            "from_pretrained changes nothing). If you trust the file, re-save its state_dict as "
            "model.safetensors (safetensors.torch.save_file) and load that directory") from None


# transformers' from_pretrained options. Where files come from: passed to huggingface_hub for a Hub name.
_DOWNLOAD_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "proxies")
# Options that change nothing here: no code is ever run from a checkpoint (trust_remote_code), .bin files
# are always read with weights_only=True, safetensors or .bin hold the same weights, and the rest
# transformers 5 ignores itself.
_NO_EFFECT_KWARGS = ("trust_remote_code", "weights_only", "use_safetensors", "disable_mmap", "low_cpu_mem_usage",
                     "_fast_init", "mirror", "from_tf", "from_flax", "offload_state_dict", "_from_auto",
                     "_from_pipeline", "tqdm_class", "_commit_hash")
_QUANTIZE = "load the fp32 model and call rf.quantize(model) (int8 or fp16-weight CPU inference)"
# Options whose effect roberta_fast does not implement: refused unless left at their default.
_UNSUPPORTED_KWARGS = {
    "quantization_config": _QUANTIZE, "load_in_8bit": _QUANTIZE, "load_in_4bit": _QUANTIZE,
    "subfolder": "pass the subfolder's own path (download a Hub repository's subfolder first)",
    "variant": "pass a directory whose weights are model.safetensors or pytorch_model.bin",
    "gguf_file": "convert the GGUF file to an HF directory first",
    "key_mapping": "rename the weights to transformers' RoBERTa names first",
    "max_memory": "the whole model is loaded on one device (`device=`)",
    "offload_folder": "the whole model is loaded on one device (`device=`)",
    "offload_buffers": "the whole model is loaded on one device (`device=`)",
    "tp_plan": "roberta_fast has no tensor parallelism; wrap the model in DistributedDataParallel to train on several GPUs",
    "tp_size": "roberta_fast has no tensor parallelism",
    "distributed_config": "roberta_fast has no tensor parallelism",
    "device_mesh": "roberta_fast has no tensor parallelism",
    "adapter_kwargs": "load the model, then the adapter with peft.PeftModel.from_pretrained",
    "use_kernels": "roberta_fast's own kernels run with backend='fused'",
    "kernel_config": "roberta_fast's own kernels run with backend='fused'",
    "fusion_config": "roberta_fast's own kernels run with backend='fused'",
    "state_dict": "build the model from its config and call load_state_dict",
}
# transformers' config attributes a from_pretrained keyword may set, besides RobertaConfig's fields.
_CONFIG_KWARGS = ("num_labels", "id2label", "label2id", "problem_type", "use_cache", "tie_word_embeddings",
                  "architectures", *DECODER_SETTINGS)


def _loading_options(kwargs: dict) -> dict:
    """Pop transformers' from_pretrained options from `kwargs`: returns the Hub download ones; drops
    those with no effect here; refuses, naming the argument, those whose effect is not implemented."""
    for name in _NO_EFFECT_KWARGS:
        kwargs.pop(name, None)
    for name, advice in _UNSUPPORTED_KWARGS.items():
        value = kwargs.pop(name, None)
        if value not in (None, False, "", {}):
            raise ValueError(f"from_pretrained({name}={value!r}) is not supported by roberta_fast: {advice}")
    attn = kwargs.pop("attn_implementation", None)
    error = attn_implementation_error(attn, f"from_pretrained(attn_implementation={attn!r})")
    if error:
        raise ValueError(error)
    return {name: kwargs.pop(name) for name in _DOWNLOAD_KWARGS if name in kwargs}


def _torch_dtype(value) -> torch.dtype | None:
    """A torch dtype from transformers' spellings: torch.float16, "float16", "torch.float16" (None stays None)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={value!r} is not a torch dtype: pass torch.float32, 'float16', 'bfloat16' or 'auto'")
    return dtype


def _checkpoint_dtype(config: RobertaConfig, hf_state: dict) -> torch.dtype:
    """dtype="auto", as transformers resolves it: the config's dtype (or its older torch_dtype),
    else the dtype of the checkpoint's first floating-point weight."""
    named = config.extra.get("dtype") or config.extra.get("torch_dtype")
    if named not in (None, "auto"):
        return _torch_dtype(named)
    floating = [t.dtype for t in hf_state.values() if t.is_floating_point()]
    return floating[0] if floating else torch.get_default_dtype()


def _single_device(device_map):
    """transformers' device_map naming one device ("cpu", "cuda:0", 0, a torch.device, {"": device}) ->
    that device, None for None; a map spreading the model over devices is refused."""
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map is None or isinstance(device_map, torch.device):
        return device_map
    try:
        device = torch.device(device_map) if isinstance(device_map, (str, int)) else None
    except RuntimeError:
        device = None
    if device is None or device.type in ("meta", "disk"):
        raise ValueError(
            f"from_pretrained(device_map={device_map!r}) is not supported: roberta_fast loads the whole model on "
            "one device; pass device='cuda' (or device_map='cuda:0', 'cpu'), or call .to(device) after loading")
    return device


def _updated_config(config, kwargs: dict) -> RobertaConfig:
    """A copy of `config` (a RobertaConfig, a transformers config or a path) with the keywords of `kwargs`
    that name config attributes popped and applied, checked as a config.json's (num_labels renames the
    classes LABEL_0, ... when it changes their count)."""
    if not isinstance(config, RobertaConfig):
        config = (RobertaConfig.from_dict(config.to_dict()) if hasattr(config, "to_dict")
                  else RobertaConfig.from_pretrained(config))
    fields = {f.name for f in dataclasses.fields(RobertaConfig)} - {"extra"}
    updates = {k: kwargs.pop(k) for k in list(kwargs) if k in fields | set(_CONFIG_KWARGS) | set(config.extra)}
    num_labels = updates.pop("num_labels", None)
    config = dataclasses.replace(config, **{k: v for k, v in updates.items() if k in fields},
                                 extra=copy.deepcopy({**config.extra, **{k: v for k, v in updates.items()
                                                                          if k not in fields}}))
    if num_labels is not None:
        config.num_labels = num_labels
    return config


def load_pretrained(cls, path_or_model, backend: str = "auto", dtype: torch.dtype | None = None,
                    device: str | torch.device | None = None, revision: str | None = None,
                    output_loading_info: bool = False, torch_dtype: torch.dtype | None = None,
                    ignore_mismatched_sizes: bool = False, config=None, device_map=None, **kwargs):
    """Build `cls` (RobertaModel or RobertaForMaskedLM) from an HF checkpoint: a directory,
    a Hub name (`revision` picks a branch, tag or commit) or a `transformers` model.

    Encoder weights must all be present; a head absent from the checkpoint (the pooler
    of an MLM checkpoint, the MLM head of a bare encoder) is initialised and reported,
    as transformers does. The model comes back in eval mode (dropout off), as transformers'
    from_pretrained returns it; call .train() to fine-tune. output_loading_info=True returns
    (model, {"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"}) as transformers
    does (native key names). dtype (torch_dtype: transformers' older name) defaults to fp32, unlike
    transformers 5, whose default is "auto"; dtype="auto" loads in the checkpoint's dtype, as there.
    ignore_mismatched_sizes=True initialises (and reports) the weights whose shape differs from
    the model's, as transformers does (a head loaded with another num_labels); without it they are refused.

    As transformers' from_pretrained: `config=` replaces the checkpoint's config; keywords naming
    config attributes (problem_type, id2label, num_labels, classifier_dropout, output_hidden_states,
    hidden_dropout_prob, ...) set them on it; the Hub options (cache_dir, local_files_only, token, ...)
    go to huggingface_hub; device_map may name one device. Options with no effect here are accepted
    (trust_remote_code, low_cpu_mem_usage, ...), those whose effect is not implemented are refused
    (ValueError), and any other keyword must be an argument of `cls` (TypeError otherwise).
    """
    dtype = dtype if dtype is not None else torch_dtype
    if dtype != "auto":
        dtype = _torch_dtype(dtype)
    download = _loading_options(kwargs)
    map_device = _single_device(device_map)
    device = device if device is not None else map_device
    checkpoint_config, hf_state = read_hf_checkpoint(path_or_model, revision, **download)
    config = _updated_config(checkpoint_config if config is None else config, kwargs)
    if dtype == "auto":
        dtype = _checkpoint_dtype(config, hf_state)
    arguments = set(inspect.signature(cls.__init__).parameters) - {"self", "config", "backend"}
    unknown = sorted(set(kwargs) - arguments)
    if unknown:
        raise TypeError(f"{cls.__name__}.from_pretrained got unexpected keyword arguments {unknown}: neither "
                        f"transformers' loading options, config attributes, nor arguments of {cls.__name__}")
    from .model import RobertaForMaskedLM

    if issubclass(cls, RobertaForMaskedLM):  # before the model is built, whose own refusal names no checkpoint
        _refuse_untied_decoder(config, _align_prefix(hf_state, "roberta."), "roberta.")
    # The checkpoint is checked against a model of shapes only, so a config claiming a far larger model
    # than its weights (from a directory someone else made) is refused before that model is allocated.
    with torch.device("meta"):
        model = cls(config, backend=backend, **kwargs)
    prefix = "roberta." if hasattr(model, "roberta") else ""
    hf_state = _align_prefix(hf_state, prefix)
    # An MLM head where the model has none is unused, reported by the checkpoint's names as transformers
    # reports it (its decoder too, which hf_to_native would take as the tied word embeddings).
    unused_head = [] if hasattr(model, "lm_head") else [k for k in hf_state if k.startswith("lm_head.")]
    state, unknown = hf_to_native({k: v for k, v in hf_state.items() if k not in unused_head}, prefix)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) | set(unknown) | set(unused_head))
    head_prefixes = (prefix + "pooler.",) + _HEADS
    essential = sorted(n for k in missing if not k.startswith(head_prefixes) for n in _hf_names(k, prefix))
    if essential:
        raise ValueError(f"checkpoint lacks encoder weights: {essential[:8]}{' ...' if len(essential) > 8 else ''}")
    mismatched = []
    for key in list(state):
        if key in expected and state[key].shape != expected[key].shape:
            if not ignore_mismatched_sizes:
                names = _hf_names(key, prefix)  # the checkpoint's names; a fused qkv is three of a third each
                shapes = [(t.shape[0] // len(names), *t.shape[1:]) for t in (state[key], expected[key])]
                raise MismatchedSizes(f"checkpoint weight {' / '.join(names)} has shape {shapes[0]}, the config "
                                      f"implies {shapes[1]}")
            mismatched.append((key, tuple(state.pop(key).shape), tuple(expected[key].shape)))
    if mismatched:
        warnings.warn(f"newly initialised (shape differs from the checkpoint's): {mismatched}", stacklevel=3)
    if missing:
        warnings.warn(f"newly initialised (not in the checkpoint): {missing}", stacklevel=3)
    if unexpected:
        warnings.warn(f"checkpoint weights not used by {cls.__name__}: {unexpected}", stacklevel=3)
    if torch.empty(0).is_meta:
        raise RuntimeError("You are using `from_pretrained` with a meta device context manager (torch.device('meta')): "
                           "the weights would not be loaded; call from_pretrained outside it")
    # Copies of the checkpoint's tensors become the shapes-only model's parameters: nothing loaded is first
    # initialised at random (half of roberta-large's load time), and none of them stays in the file's
    # memory map (a file rewritten in place later would change them) or shared with a transformers model.
    target = dtype if dtype is not None else torch.float32
    model.load_state_dict({k: state.pop(k).to(target, copy=True) for k in list(state) if k in expected},
                          strict=False, assign=True)
    _init_missing(model, target)
    if device is not None:
        model.to(device=device)
    model.eval()
    name = getattr(path_or_model, "name_or_path", "") if isinstance(path_or_model, torch.nn.Module) else path_or_model
    for module in model.modules():  # the model and its encoder, as transformers' share their config's
        if hasattr(module, "name_or_path"):
            module.name_or_path = str(name)
    if output_loading_info:
        return model, {"missing_keys": set(missing), "unexpected_keys": set(unexpected),
                       "mismatched_keys": mismatched, "error_msgs": []}
    return model


def _init_missing(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Allocate and initialise, as a new model's, the parameters the checkpoint did not hold (still on
    the meta device): a new task head, a pooler. The model's _init_weights for Linear, Embedding and
    LayerNorm weights; the other parameters (a decoder bias) start at zero, as their modules make them."""
    for module in model.modules():
        params = dict(module.named_parameters(recurse=False))
        if not any(p.is_meta for p in params.values()):
            continue
        loaded = {name: p for name, p in params.items() if not p.is_meta}
        module.to_empty(device="cpu", recurse=False)
        module.to(dtype)
        for p in module.parameters(recurse=False):
            torch.nn.init.zeros_(p)
        model._init_weights(module)
        for name, p in loaded.items():
            setattr(module, name, p)


def _refuse_untied_decoder(config: RobertaConfig, hf_state: dict, prefix: str) -> None:
    """The MLM decoder here *is* the word embeddings; a checkpoint whose decoder differs, or whose
    config says tie_word_embeddings=false, would silently lose its trained decoder, so it is refused."""
    decoder = hf_state.get("lm_head.decoder.weight")
    embeddings = hf_state.get(prefix + "embeddings.word_embeddings.weight")
    differs = (decoder is not None and embeddings is not None
               and (decoder.shape != embeddings.shape or not torch.equal(decoder, embeddings)))
    if differs:
        raise ValueError(untied_decoder_error("this masked-LM checkpoint has"))
    if not config.tie_word_embeddings:
        raise ValueError(untied_decoder_error("the config (the checkpoint's, config= or a keyword) asks for"))


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
                    architecture: str | None = None, state_dict: dict | None = None,
                    max_shard_size: int | str = "50GB"):
    """Write config.json and the weights in HF's layout, each file atomically: model.safetensors, or
    past max_shard_size (bytes, or transformers' "5GB" / "500MiB") shards model-00001-of-0000N.safetensors
    with transformers' model.safetensors.index.json; weight files of an earlier save that this one
    does not replace are removed, so the directory holds one set.

    exclude_prefix: parameters left out (a head transformers does not know, saved apart);
    architecture: the class name config.json gives (default: the model's);
    state_dict: saved instead of the model's own (native names, converted as the model's are)."""
    from safetensors.torch import save_file

    from .files import atomic_path, write_text_atomic
    from .quantization import refuse_quantized

    refuse_quantized(model, "save_pretrained", state_dict)
    prefix = "roberta." if hasattr(model, "roberta") else ""
    state = model.state_dict() if state_dict is None else state_dict
    if exclude_prefix:
        state = {k: v for k, v in state.items() if not k.startswith(exclude_prefix)}
    hf_state = native_to_hf(state, prefix)  # (before the directory is made: it may refuse the state)
    hf_state = {k: v.detach().to("cpu").contiguous() for k, v in hf_state.items()}
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    shards = _shards(hf_state, _size_in_bytes(max_shard_size))
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards):
        with atomic_path(os.path.join(directory, name)) as tmp:  # (save_file alone writes 0600)
            save_file(shard, tmp, metadata={"format": "pt"})
    index = os.path.join(directory, "model.safetensors.index.json")
    if len(shards) > 1:
        weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
        total = sum(t.numel() * t.element_size() for t in hf_state.values())
        write_text_atomic(index, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                            indent=2, sort_keys=True) + "\n")
    for stale in os.listdir(directory):  # an earlier save's weights, which loaders would read first
        if (stale not in names and (WEIGHT_SHARD.fullmatch(stale)
                                    or stale == "model.safetensors" or (stale == os.path.basename(index)
                                                                        and len(shards) == 1))):
            os.remove(os.path.join(directory, stale))
    floating = [t.dtype for t in hf_state.values() if t.is_floating_point()]
    model.config.save_pretrained(directory, architectures=[architecture or type(model).__name__],
                                 dtype=str(floating[0]).removeprefix("torch.") if floating else None)


def _size_in_bytes(size: int | str) -> int:
    """transformers' max_shard_size: bytes, or "5GB" (10**9), "5GiB" (2**30), MB / MiB / KB / KiB."""
    if isinstance(size, int):
        return size
    units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3}
    match = re.fullmatch(r"(\d+)\s*([GMK]I?B)", str(size).strip(), re.IGNORECASE)
    if match is None:
        raise ValueError(f"max_shard_size={size!r}: give a number of bytes or a size such as '5GB' or '500MiB'")
    return int(match.group(1)) * units[match.group(2).upper()]


def _shards(state: dict, max_bytes: int) -> list[dict]:
    """`state` split in order into shards of at most max_bytes (a larger tensor alone), as transformers splits."""
    shards, size = [{}], 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards
