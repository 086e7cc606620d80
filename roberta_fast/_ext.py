"""Loads the compiled extension `roberta_fast._C`, or says exactly how to build it."""
from functools import lru_cache

import torch  # noqa: F401  (loads libc10 and libtorch, which _C links against)


@lru_cache(maxsize=None)
def load():
    """Return the `roberta_fast._C` module; raise ImportError naming the fix if absent."""
    try:
        from roberta_fast import _C
    except ImportError as err:
        raise ImportError(
            "roberta_fast's compiled extension (roberta_fast._C) could not be imported: "
            f"{err}.\nBuild it against the installed torch from the repository root with\n"
            "    pip install --no-build-isolation -e .\n"
            "(a torch upgrade after building also requires this rebuild)."
        ) from err
    return _C


@lru_cache(maxsize=None)
def optional(name: str):
    """The compiled op `name`, or None where the extension is missing or was built before the op
    existed (a checkout updated without the rebuild): for callers whose Python path computes the same."""
    try:
        return getattr(load(), name, None)
    except ImportError:
        return None
