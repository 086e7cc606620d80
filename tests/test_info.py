"""python -m roberta_fast.info: the versions, the extension and, per device, what runs, read from the
functions the model decides with; --check runs each fast path once against its reference."""
import types

import pytest
import torch

from roberta_fast import _ext, info, ops
from roberta_fast.quantization import default_engine


def test_the_report_names_the_versions_the_extension_and_the_cpus_paths(capsys):
    assert info.main([]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "transformers " in out and "tokenizers " in out
    built = "CUDA ops built" if _ext.load().built_with_cuda() else "CPU ops only"
    assert f"extension: roberta_fast._C {_ext.load().version()}, {built}" in out
    assert f"vector ISA {torch.backends.cpu.get_cpu_capability()}" in out
    assert f"rf.quantize: engine {default_engine()}, " in out
    if not torch.cuda.is_available():
        assert "gpu: none visible to torch" in out


def test_check_runs_every_cpu_check_and_a_failure_is_status_1(capsys, monkeypatch):
    assert info.main(["--check"]) == 0
    checks = capsys.readouterr().out.split("checks:\n")[1].splitlines()
    assert [line.split(":")[0] for line in checks] == ["  ok    FusedAdam (CPU)", "  ok    mask_tokens (CPU)",
                                                       "  ok    int8 model, rf.quantize (CPU)"]

    def wrong(device):
        raise AssertionError("max |difference| to torch.optim.AdamW 3.00e-02 (> 1e-6)")

    monkeypatch.setattr(info, "_adam", wrong)
    assert info.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "  FAIL  FusedAdam (CPU): AssertionError: max |difference| to torch.optim.AdamW 3.00e-02" in out
    assert "  ok    mask_tokens (CPU)" in out  # the others still run


def test_the_fused_model_check_compares_with_the_reference(monkeypatch):
    """The GPU check's comparison, on the CPU: a fast path computing another function fails it."""
    assert "relative difference" in info._model(torch.device("cpu"), "fp32")
    from roberta_fast.model import RobertaForMaskedLM

    forward, calls = RobertaForMaskedLM.forward, []

    def off(self, *args, **kwargs):  # the second model run, the fast path's, computes 1% more loss
        out = forward(self, *args, **kwargs)
        calls.append(self)
        if len(calls) == 2:
            out.loss = out.loss * 1.01
        return out

    monkeypatch.setattr(RobertaForMaskedLM, "forward", off)
    with pytest.raises(AssertionError, match="against the reference's"):
        info._model(torch.device("cpu"), "fp32")


def test_faked_gpus_are_described_by_what_runs_on_them(monkeypatch):
    """A V100 (sm_70) and an H100 (sm_90) under a torch built for sm_80 and sm_90 only."""
    names = {0: ("Tesla V100-SXM2-16GB", (7, 0)), 1: ("NVIDIA H100 80GB HBM3", (9, 0))}
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_90"])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(name=names[d.index][0], total_memory=16 * 2 ** 30))
    monkeypatch.setattr(ops, "device_capability", lambda d: names[d.index][1])
    monkeypatch.setattr(ops, "_triton_available", lambda: True)
    v100, v100_backend, v100_attention, h100, backend, attention = info.gpus()
    assert v100.startswith("gpu 0: Tesla V100-SXM2-16GB, sm_70, 16.0 GiB; THIS TORCH HAS NO KERNELS FOR sm_70")
    assert h100 == "gpu 1: NVIDIA H100 80GB HBM3, sm_90, 16.0 GiB"
    assert "fp16 autocast with dynamic loss scaling" in v100_backend
    assert "memory-efficient kernel (sm_70" in v100_attention
    assert backend.startswith("  backend auto -> fused; precision auto -> bf16 autocast")
    assert attention.startswith("  attention: Triton flash-style kernel; LayerNorm, bias+GELU, MLM cross-entropy: "
                                "Triton kernels")
