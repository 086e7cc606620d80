"""The compiled extension roberta_fast._C: it loads, reports how it was built, and a
missing build fails with an ImportError naming the fix."""
import sys

import pytest
import torch

import roberta_fast
from roberta_fast import _ext


def test_version_and_build_facts():
    C = _ext.load()
    assert C.version() == roberta_fast.__version__
    assert isinstance(C.built_with_cuda(), bool)
    if torch.cuda.is_available() and torch.version.cuda is not None:
        # A CUDA machine must have built the CUDA ops (setup.py adds them with nvcc).
        assert C.built_with_cuda(), "rebuild with `pip install --no-build-isolation -e .`"


def test_ops_are_exposed():
    C = _ext.load()
    for name in ("adam_step", "grad_sumsq", "mask_tokens", "philox4x32", "quantize_activations",
                 "check_activations_finite", "inference_layer"):
        assert callable(getattr(C, name)) and getattr(C, name).__doc__


def test_missing_extension_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "roberta_fast._C", None)   # makes the import fail
    monkeypatch.delattr(roberta_fast, "_C", raising=False)
    with pytest.raises(ImportError, match="pip install --no-build-isolation -e ."):
        _ext.load.__wrapped__()


def test_unsupported_device_is_explained():
    """Tensors on a device the ops do not serve get a ValueError, not a crash."""
    C = _ext.load()
    ids = torch.zeros(1, 2, dtype=torch.int64).to("meta")
    with pytest.raises(ValueError, match="unsupported device"):
        C.mask_tokens(ids, None, 0, 0, 0, 0, 0, 0.15, 0.8, 0.1, 10, 9, [0])
    with pytest.raises(ValueError, match="unsupported device"):
        p = torch.zeros(3, device="meta")
        C.adam_step([p], [p], [p], [p], [], [torch.zeros((), device="meta")],
                    1e-3, 0.9, 0.98, 1e-6, 0.0)
    with pytest.raises(ValueError, match="unsupported device"):
        C.quantize_activations(torch.zeros(3, device="meta"), 127)


def test_setup_leaves_the_cpp_standard_to_torch():
    """A -std flag in setup.py wins over the one torch's build adds, and torch 2.14's headers refuse
    C++17 (the install failed on 2.14 and 2.15 with -std=c++17): setup.py must name none."""
    import re
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    code = "\n".join(line.split("#")[0] for line in setup.splitlines())
    assert not re.search(r"-std=", code), "setup.py passes a -std flag; leave the standard to torch"
