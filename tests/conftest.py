"""Shared test setup.

Without a GPU the Triton kernels run in Triton's interpreter; the variable must be
set before triton is first imported, so it is set here, at collection time.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", "cuda"] if HAS_CUDA else ["cpu"]


@pytest.fixture(params=DEVICES)
def device(request):
    """Every device present: the CPU always, the GPU where there is one."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
