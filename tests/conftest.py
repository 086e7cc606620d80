"""Shared test setup.

Without a GPU the Triton kernels run in Triton's interpreter; the variable must be
set before triton is first imported, so it is set here, at collection time, and the
interpreter is patched to compute bf16 dots and casts as a GPU does
(tests/interpreter_bf16.py), so the bf16 tests run on the CPU too.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_bf16

    interpreter_bf16.install()

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", "cuda"] if HAS_CUDA else ["cpu"]


@pytest.fixture(params=DEVICES)
def device(request):
    """Every device present: the CPU always, the GPU where there is one."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
