"""A checkpoint file whose pickle runs a shell command when fully unpickled, for the
tests that check no loader of ours ever runs it (the command only creates `marker`)."""
import os

import torch


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):  # unpickling calls os.system("touch <marker>")
        return (os.system, (f"touch '{self.marker}'",))


def write_malicious_checkpoint(path, marker) -> None:
    """A plausible step checkpoint at `path` with the payload inside."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"step": 5, "model": {}, "rng": [_RunsCode(marker)]}, path)
