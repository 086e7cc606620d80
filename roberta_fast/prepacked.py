"""`rf.prepack(model)` (this module is roberta_fast.prepacked): fp32 CPU inference with the encoder's
Linear weights packed once, in oneDNN's layout.

    model = rf.RobertaForSequenceClassification.from_pretrained(path)
    rf.prepack(model)               # in place, returned for chaining; eval mode, parameters frozen
    with torch.inference_mode():
        logits = model(input_ids, attention_mask=mask).logits

Why: nn.Linear on the CPU (aten::addmm) runs MKL's sgemm on the plain weight, which a BLAS lays
out for its kernel inside each call. On few tokens that is much of the matmul:
on the 2-core AMD EPYC (docs/inference.md), roberta-base at 1 x 16 tokens spent 89% of its
time in addmm, and one block's four matmuls took 5.6 ms plainly, 3.1 ms on weights packed once
(torch.ops.mkldnn._reorder_linear_weight, run by oneDNN's brgemm through
mkldnn._linear_pointwise: the kernels torch.compile's CPU freezing path emits). The four Linear
layers of every block become `PackedLinear`; the packed copy replaces the original (one copy of
the weights), and the FFN's GELU runs in the matmul's epilogue (erf, as F.gelu). An MLM head's
decoder runs on a packed copy of the word embeddings it is tied to (`TiedDecoder`; the lookup
keeps the table). The function is the same, in fp32: outputs differ from the plain model's by
fp32 summation order only.

`_InferenceLinear` is also the base of rf.quantize's Int8Linear: a Linear layer held in a kernel
library's packed form, for inference only (training and gradients are refused), whose
state_dict is read back from the packed form (it changes only through load_state_dict: the
attributes that read it back are copies, which cannot be assigned), and which torch.export and
jit.trace see as plain aten ops on constant weights (the packed tensors are opaque to them).
"""
from __future__ import annotations

import contextlib
import types

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .ops import exporting

LAYER_LINEARS = ("qkv", "attn_out", "ffn_in", "ffn_out")  # RobertaLayer's four projections


class _InferenceLinear(nn.Module):
    """nn.Linear's forward, for inference, on weights held once by `self._kernel`: a holder whose
    __call__(x, post_op) runs the packed kernel, whose spec(tokens) names that kernel and its weight
    for the C++ inference layer, and whose unpack() reads the STATE tensors back.
    Subclasses pack (`_pack`), name the state (`STATE`, `_expected_state`) and say what
    export traces (`_traced`)."""

    STATE: tuple[str, ...] = ()
    KIND = "packed"  # in errors: "a {KIND} model", made by FUNCTION
    FUNCTION = ""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.has_bias = linear.bias is not None

    def forward(self, x):
        return self._run(x, gelu=False)

    def forward_gelu(self, x):
        """erf GELU(self(x)) (the FFN's first layer), in the kernel's epilogue where it has one: on
        the output still in cache, the same values as F.gelu."""
        return self._run(x, gelu=True)

    def inference_spec(self, tokens: int) -> tuple | None:
        """The kernel a call on `tokens` rows runs, as the C++ inference layer takes it
        (csrc/inference_layer.cpp); None where a call would refuse (training)."""
        return None if self.training else self._kernel.spec(tokens)

    def replaced_numel(self) -> int:
        """The parameters of the nn.Linear this layer replaced (num_parameters counts them)."""
        return self.out_features * (self.in_features + self.has_bias)

    def _run(self, x, gelu: bool):
        if self.training:
            raise RuntimeError(f"a {self.KIND} model is for inference: call model.eval() (to train, train the fp32 "
                               f"model and apply {self.FUNCTION} afterwards)")
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{self.KIND} Linear layers have no gradient: run a {self.KIND} model under "
                               f"torch.no_grad() or torch.inference_mode(), with its parameters frozen "
                               f"({self.FUNCTION} freezes them)")
        if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):  # (not only its bf16 activations' dtype)
            raise RuntimeError(f"a {self.KIND} model computes in fp32 (its Linear layers on their own packed weights, "
                               f"which torch.autocast cannot cast): call it outside torch.autocast")
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise RuntimeError(f"{self.KIND} Linear layers take fp32 inputs on the CPU, got {x.dtype} on {x.device}: "
                               f"a {self.KIND} model stays fp32 on the CPU (do not .half(), .to(bfloat16) or move it; "
                               f"apply {self.FUNCTION} to a fresh fp32 copy for another device or dtype)")
        if exporting() or torch.jit.is_tracing():
            with _untraced():  # the unpacked weights enter the traced graph as constants
                state = self._kernel.unpack()
            out = self._traced(x, *state)
            return F.gelu(out) if gelu else out
        post_op = "gelu" if gelu else "none"
        if torch.compiler.is_compiling():
            return _outside_the_graph()(self._kernel, x, post_op)
        return self._kernel(x, post_op)

    def _traced(self, x, *state):
        """What torch.export and jit.trace record for this layer, on the unpacked state."""
        raise NotImplementedError

    def _expected_state(self) -> dict:
        """{state_dict name: (shape, dtype)} of this layer's state."""
        raise NotImplementedError

    def _with_bias(self, **state) -> dict:
        """`state` ({name: (shape, dtype)}), then the fp32 bias when the layer has one."""
        return {**state, "bias": ((self.out_features,), torch.float32)} if self.has_bias else state

    def _pack(self, state: dict):
        """A new kernel holder for these state tensors."""
        raise NotImplementedError

    def __setattr__(self, name, value):
        if name in self.STATE:  # else nn.Module's KeyError "attribute already exists", or a silent no-op
            raise AttributeError(f"{type(self).__name__}.{name} is read back from the packed weights and cannot be "
                                 f"assigned: load new values with model.load_state_dict(state) (strict=False for "
                                 f"a few keys), which packs them again")
        super().__setattr__(name, value)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}"

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, tensor in zip(self.STATE, self._kernel.unpack()):
            if tensor is not None:
                destination[prefix + name] = tensor

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Check the state tensors' shapes and dtypes, then pack them (nn.Module's checks, by hand:
        the state lives in the packed weight, not in parameters or buffers). A partial state_dict
        (strict=False, e.g. biases only) changes what it gives and keeps the rest, as nn.Module
        keeps a parameter the dict lacks: the rest is read back from the packed kernel."""
        expected = self._expected_state()
        found = {}
        for name, (shape, dtype) in expected.items():
            if prefix + name not in state_dict:
                missing_keys.append(prefix + name)
                continue
            tensor = state_dict[prefix + name]
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                error_msgs.append(f"{prefix}{name}: expected {dtype} of shape {shape} (a {self.FUNCTION} state_dict "
                                  f"of the same config), got {tensor.dtype} of shape {tuple(tensor.shape)}")
                continue
            found[name] = tensor
        if strict:
            unexpected_keys.extend(key for key in state_dict if key.startswith(prefix) and "." not in
                                   key[len(prefix):] and key[len(prefix):] not in expected)
        if found:
            current = dict(zip(self.STATE, self._kernel.unpack()))
            self._kernel = self._pack({name: found.get(name, current[name]) for name in expected})


class PackedLinear(_InferenceLinear):
    """nn.Linear's forward in fp32 on a weight packed once in oneDNN's layout (rf.prepack). Its
    state_dict is nn.Linear's (`weight`, `bias`), read back from the packed weight."""

    STATE = ("weight", "bias")
    KIND = "prepacked"
    FUNCTION = "rf.prepack"

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self._kernel = _OnednnFp32Weight(linear.weight, linear.bias)

    @property
    def weight(self):
        """(out, in) fp32, a fresh copy read back from the packed weight: an in-place edit of it
        changes nothing the layer can see, and assigning one is refused. The packed weights change
        only through load_state_dict."""
        return self._kernel.unpack()[0]

    @property
    def bias(self):
        """(out,) fp32 or None, a fresh copy (without reading the packed weight back); as `weight`,
        it changes only through load_state_dict."""
        return None if self._kernel.bias is None else self._kernel.bias.clone()

    def _traced(self, x, weight, bias):
        return F.linear(x, weight, bias)

    def _expected_state(self) -> dict:
        return self._with_bias(weight=((self.out_features, self.in_features), torch.float32))

    def _pack(self, state: dict):
        return _OnednnFp32Weight(state["weight"], state.get("bias"))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp32 weights packed by oneDNN"


def by_value(tensors) -> tuple:
    """A packed-weight holder's pickled state: its tensors as numpy arrays (None kept), which every pickler
    copies by value. torch.multiprocessing would share tensors through file descriptors instead, and
    these, unpacked for the pickle alone, are freed (their descriptors closed) before a spawned process
    reads them: a prepacked or int8 model could not be sent to one (sentence-transformers' process pool)."""
    return tuple(None if t is None else t.numpy() for t in tensors)


def as_tensors(state) -> tuple:
    """by_value's state (or an older pickle's tensors) as tensors."""
    return tuple(torch.from_numpy(t) if isinstance(t, np.ndarray) else t for t in state)


class _OnednnFp32Weight:
    """An fp32 Linear weight in oneDNN's blocked layout, run by oneDNN's matmul with an optional
    post-op. The only copy (to_dense reads it back). A plain holder, not module state: torch.export
    and deepcopy cannot handle an opaque mkldnn tensor (__getstate__ unpacks)."""

    def __init__(self, weight, bias):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), None)  # (out, in)
        self.bias = None if bias is None else bias.detach().float().clone()

    def unpack(self):
        return self.packed.to_dense(), None if self.bias is None else self.bias.clone()

    def __getstate__(self):
        return by_value(self.unpack())

    def __setstate__(self, state):
        self.__init__(*as_tensors(state))

    def spec(self, tokens: int) -> tuple:
        """What __call__ runs, for the C++ inference layer (csrc/inference_layer.cpp)."""
        return ("linear_pointwise", self.packed, self.bias)

    def __call__(self, x, post_op="none"):
        """The layer's output, with oneDNN's `post_op` applied to it ("gelu": erf GELU)."""
        algorithm = "none" if post_op == "gelu" else ""  # oneDNN's GELU algorithms: "none" (erf) or "tanh"
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, post_op, [], algorithm)


_RUN_EAGERLY = []


def _outside_the_graph():
    """kernel(x, post_op), run eagerly under torch.compile: a graph break, as dynamo can neither fake
    an opaque oneDNN weight nor trace fbgemm's TorchScript object. Made on first use, since
    torch.compiler.disable imports torch._dynamo (1.8 s) and most models never compile."""
    if not _RUN_EAGERLY:
        _RUN_EAGERLY.append(torch.compiler.disable(lambda kernel, x, post_op: kernel(x, post_op)))
    return _RUN_EAGERLY[0]


@contextlib.contextmanager
def _untraced():
    """Run eagerly, unseen by torch.export's tracing modes and torch.jit.trace's tracer, so that
    what is computed (the unpacked weights) enters the traced graph as constant tensors."""
    tracing_state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        with torch.utils._python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
            yield
    finally:
        torch._C._set_tracing_state(tracing_state)


def encoder_linears(model: nn.Module, function: str):
    """[(layer, name)] of every encoder block's four Linear layers, after checking that `model` is a
    roberta_fast model; `function` (e.g. "rf.prepack") names the caller in errors."""
    from .model import RobertaLayer

    layers = [m for m in model.modules() if isinstance(m, RobertaLayer)] if isinstance(model, nn.Module) else []
    if not layers:
        raise ValueError(f"{function} takes a roberta_fast model (RobertaModel, RobertaFor*), got "
                         f"{type(model).__name__}; for a transformers model use rf.RobertaModel.from_pretrained(it)")
    for p in model.parameters():
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise ValueError(f"{function} takes an fp32 model on the CPU (its kernels are CPU kernels), got "
                             f"{p.dtype} on {p.device}; use model.float().cpu() first")
    slots = [(layer, name) for layer in layers for name in LAYER_LINEARS]
    for layer, name in slots:
        module = getattr(layer, name)
        if not isinstance(module, (nn.Linear, _InferenceLinear)):
            kind = f"{type(module).__module__}.{type(module).__qualname__}"  # e.g. peft.tuners.lora.layer.Linear
            raise ValueError(f"{function}: {name} of an encoder block is a {kind}, not torch's nn.Linear, and its "
                             "weights would be packed without it; merge adapters into the weights first (peft: "
                             "model = model.merge_and_unload())")
    return slots


class TiedDecoder(nn.Module):
    """RobertaForMaskedLM's decoder under rf.prepack or rf.quantize: logits = x @ word_embeddings.T +
    bias, run by a packed copy of the word embeddings (a PackedLinear, Int8Linear or
    Fp16WeightLinear, `layer_class`, as the encoder's layers), the fp32 table kept for the lookup.
    Why: it is roberta-base's largest matmul (768 -> 50265). At 1 x 16 tokens it took 29 ms on the
    plain table, 8.4 packed in fp32, 7.8 with fp16 weights and 2.9 in int8 (2-core AVX-512 VNNI
    CPU, docs/inference.md); ONNX Runtime packs it, and its quantize_dynamic quantizes it. The copy
    is not model state (the state_dict keeps the tied fp32 weight and lm_head.bias) nor a
    submodule's. An eager call rebuilds it after a load_state_dict of the model or its lm_head,
    and when either tensor has been replaced (resize_token_embeddings) or edited in place through
    itself (e.g. get_output_embeddings().weight.mul_(2) under no_grad: its version counter moves).
    It cannot see writes through `.data` (weight.data[i] = ...) nor other in-place edits of
    inference tensors (made under inference_mode, they keep no version counter): seeing them would
    take reading the whole table every call (6 ms for roberta-base's, 15% of a prepacked 1 x 16
    forward), so after those call rf.prepack(model) or rf.quantize(model) again, which rebuild it.
    A load_state_dict of the model (attach_tied_decoder's post-hook) and set_input_embeddings
    rebuild it at once, as an export cannot; an export records F.linear on the tied table instead
    of the fp32 copy (the table once), and refuses an int8 / fp16 copy it can tell is stale.
    torch.compile runs the copy as it is."""

    def __init__(self, weight, bias, layer_class: type, **layer_kwargs):
        super().__init__()
        self.layer_class, self.layer_kwargs = layer_class, layer_kwargs
        self.rebuild(weight, bias)

    def rebuild(self, weight, bias):
        """Pack the copy afresh from these tables, now (rf.prepack and rf.quantize do, when called
        again: for the edits a call cannot see)."""
        linear = types.SimpleNamespace(weight=weight, bias=bias, in_features=weight.shape[1],
                                       out_features=weight.shape[0])  # (vocab, hidden): what Linear reads
        with torch.inference_mode(False):  # plain tensors, even when rebuilt inside a forward
            layer = self.layer_class(linear, **self.layer_kwargs)
        self.__dict__["layer"] = layer  # not registered: no state_dict keys, nothing to count twice
        self._source = _identity(weight, bias)

    def forward(self, x, weight, bias):
        tracing = exporting() or torch.jit.is_tracing()
        if not (tracing or torch.compiler.is_compiling()):
            if _identity(weight, bias) != self._source:
                self.rebuild(weight, bias)
        elif tracing and self.layer_class is PackedLinear:  # the tied table itself, recorded once (not twice)
            return F.linear(x, weight, bias)
        elif tracing and (self._source is None or tuple(weight.shape) != self._source[0][3]):
            raise RuntimeError("the MLM decoder's packed copy is older than the word embeddings (replaced or loaded "
                               "into a submodule since rf.prepack / rf.quantize): call rf.prepack(model) or "
                               "rf.quantize(model) again, or run the model once, before exporting")
        self.layer.training = self.training  # so that it refuses training as the encoder's layers do
        return self.layer(x)

    def _load_from_state_dict(self, *args, **kwargs):
        """A load of the model (or of lm_head) writes the tables in place, which inference tensors'
        missing version counters would hide: rebuild on the next call."""
        super()._load_from_state_dict(*args, **kwargs)
        self._source = None

    def extra_repr(self) -> str:
        return f"tied to the word embeddings: {self.layer.extra_repr()}"


def attach_tied_decoder(model: nn.Module, head, layer_class: type, **layer_kwargs) -> None:
    """Give the MLM head a TiedDecoder (or pack its copy afresh, for the edits a call cannot see), and
    rebuild it after every load_state_dict of the model: an export right after a load must record
    the loaded table, and an export cannot rebuild it as an eager call does."""
    weight = model.get_input_embeddings().weight
    if head.packed_decoder is None:
        head.packed_decoder = TiedDecoder(weight, head.bias, layer_class, **layer_kwargs)
    else:
        head.packed_decoder.rebuild(weight, head.bias)
    if _rebuild_tied_decoder not in model._load_state_dict_post_hooks.values():
        model.register_load_state_dict_post_hook(_rebuild_tied_decoder)


def _rebuild_tied_decoder(model: nn.Module, incompatible_keys) -> None:
    """load_state_dict post-hook (a module-level function: the model still pickles)."""
    head = mlm_head(model)
    if head is not None and head.packed_decoder is not None:
        head.packed_decoder.rebuild(model.get_input_embeddings().weight, head.bias)


def _identity(*tensors) -> tuple:
    """Which tensors, at which storage and which in-place version (inference tensors keep none): changes
    when any is replaced or edited."""
    return tuple((id(t), t.data_ptr(), None if t.is_inference() else t._version, tuple(t.shape)) for t in tensors)


def mlm_head(model: nn.Module):
    """The model's MLM head (RobertaLMHead), or None."""
    from .model import RobertaLMHead

    return next((m for m in model.modules() if isinstance(m, RobertaLMHead)), None)


def has_onednn_fp32() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def prepack(model: nn.Module) -> nn.Module:
    """Swap each encoder block's four Linear layers for PackedLinear (fp32, weights packed once by
    oneDNN), in place, and run an MLM head's decoder on a packed copy of the word embeddings
    (TiedDecoder: 154 MB more for roberta-base, the lookup keeps the table); returns the model in
    eval mode, parameters frozen. Layers already packed (by rf.prepack or rf.quantize) are left as
    they are, but for the decoder's copy, packed afresh from the current tables. Save with
    save_pretrained as before: the state_dict is the plain model's."""
    slots = encoder_linears(model, "rf.prepack")
    if not has_onednn_fp32():
        raise RuntimeError(f"rf.prepack runs oneDNN's fp32 matmul, which this torch ({torch.__version__}) lacks "
                           "(torch.backends.mkldnn.is_available() is False): use the plain model, or a torch built "
                           "with oneDNN (the x86 wheels are)")
    for layer, name in slots:
        if type(getattr(layer, name)) is nn.Linear:
            setattr(layer, name, PackedLinear(getattr(layer, name)))
    head = mlm_head(model)
    if head is not None:  # packed before (perhaps quantized): afresh, for the edits a call cannot see
        attach_tied_decoder(model, head, PackedLinear)
    model.requires_grad_(False)
    return model.eval()
