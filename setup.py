"""Build roberta_fast and its C++/CUDA extension `roberta_fast._C`.

CPU ops are always built; CUDA ops are added when the installed torch has CUDA
and `nvcc` is found (TORCH_CUDA_ARCH_LIST and MAX_JOBS are honoured by
torch.utils.cpp_extension; with neither a visible GPU nor TORCH_CUDA_ARCH_LIST,
a portable list, sm_70 (sm_75 on CUDA 13) to sm_90 plus PTX, is built). Install
with the torch you already have:

    pip install --no-build-isolation -e .

(`--no-build-isolation` stops pip from building against a second, freshly
downloaded torch: the extension must be built against the torch it runs with.)
"""
import glob
import os
import re
import shutil
import subprocess

from setuptools import setup


def point_cuda_home_at_nvcc():
    """Set CUDA_HOME to nvcc's toolkit where torch's own guess would miss it.

    torch takes CUDA_HOME to be two levels above the first `nvcc` on PATH. Where that
    nvcc is a wrapper (e.g. /usr/local/bin/nvcc running /usr/local/cuda-13.0/bin/nvcc),
    the guess (/usr/local) has no CUDA headers and the CUDA build fails on
    c10/cuda's `#include <cuda_runtime_api.h>`. nvcc itself says where its toolkit is
    (`TOP=` of --dryrun). Runs before torch.utils.cpp_extension is imported, which
    reads CUDA_HOME once; an explicit CUDA_HOME or CUDA_PATH is left alone, and a CPU
    torch (or ROBERTA_FAST_CPU_ONLY=1) builds no CUDA, so nothing is asked.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or \
            os.environ.get("ROBERTA_FAST_CPU_ONLY") == "1" or torch.version.cuda is None:
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return

    def has_headers(home):
        return os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h"))

    if has_headers(os.path.dirname(os.path.dirname(nvcc))):
        return
    try:
        dry = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return
    top = re.search(r"^#\$ TOP=(.+)$", dry.stderr + dry.stdout, re.MULTILINE)
    home = os.path.normpath(top.group(1).strip()) if top else None
    if home and has_headers(home):
        os.environ["CUDA_HOME"] = home


try:
    import torch

    point_cuda_home_at_nvcc()
    from torch.utils import cpp_extension
except ImportError as err:  # pragma: no cover - the message is the point
    raise SystemExit(
        "roberta_fast builds its extension against the installed torch, and none was found.\n"
        "Install torch first (CPU machine: `pip install torch==2.13.0`), then run\n"
        "`pip install --no-build-isolation -e .`"
    ) from err


def cuda_available_for_build() -> bool:
    """CUDA ops need a CUDA torch and nvcc; ROBERTA_FAST_CPU_ONLY=1 skips them."""
    if os.environ.get("ROBERTA_FAST_CPU_ONLY") == "1":
        return False
    if torch.version.cuda is None:
        return False
    return cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None


# Built for when no GPU is visible and TORCH_CUDA_ARCH_LIST is unset: V100, T4, A100,
# A10/RTX 30xx, L4/RTX 40xx, H100/H200, with PTX of the newest for later GPUs.
PORTABLE_CUDA_ARCHS = ("7.0", "7.5", "8.0", "8.6", "8.9", "9.0")


def default_cuda_arch_list():
    """Set TORCH_CUDA_ARCH_LIST for a CUDA build that sees no GPU (a Docker build, a login node).

    torch builds for the visible GPUs; with none, recent torch fails inside
    `_get_cuda_arch_flags` (IndexError) instead of choosing. Here the portable list is
    cut to what this nvcc can build (CUDA 13 dropped sm_70). An explicit
    TORCH_CUDA_ARCH_LIST is always honoured.
    """
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.device_count() > 0:
        return
    home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    try:
        listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError, TypeError):
        return  # torch reports the missing compiler itself
    buildable = {f"{m[:-1]}.{m[-1]}" for m in re.findall(r"compute_(\d+)", listed)}
    archs = [a for a in PORTABLE_CUDA_ARCHS if a in buildable]
    if archs:
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs) + "+PTX"
        print(f"roberta_fast: no GPU visible, building CUDA ops for TORCH_CUDA_ARCH_LIST="
              f"{os.environ['TORCH_CUDA_ARCH_LIST']} (set it to choose)")


def extension():
    here = os.path.dirname(os.path.abspath(__file__))
    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cu = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    # -fno-trapping-math: lets GCC vectorize loops with float compares (quantize_activations.cpp);
    # results stay IEEE's, only floating-point exception flags are not kept (clang's default).
    # -ffp-contract=off: no fused multiply-add where the source has a multiply and an add, so code
    # compiled for an FMA-capable ISA (quantize_activations.cpp's AVX-512 clone) rounds as the baseline does.
    # No -std flag: torch adds the standard it builds with (C++20 since 2.13; 2.14's headers refuse C++17), nvcc too
    cxx = ["-O3", "-fopenmp", "-fno-trapping-math", "-ffp-contract=off"]
    include = [os.path.join(here, "csrc")]
    if cuda_available_for_build() and cu:
        default_cuda_arch_list()
        nvcc = ["-O3", "--use_fast_math", "-lineinfo"]
        return cpp_extension.CUDAExtension(
            "roberta_fast._C",
            cpp + cu,
            include_dirs=include,
            define_macros=[("WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=["-fopenmp"],
        )
    return cpp_extension.CppExtension(
        "roberta_fast._C",
        cpp,
        include_dirs=include,
        extra_compile_args={"cxx": cxx},
        extra_link_args=["-fopenmp"],
    )


setup(
    packages=["roberta_fast", "roberta_fast.kernels"],
    package_dir={"roberta_fast": "roberta_fast", "roberta_fast.kernels": "kernels"},
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
