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


def write_dotted_name_checkpoint(path, marker) -> None:
    """A torch zip checkpoint whose pickle asks for `torch._utils` `_rebuild_tensor.__builtins__.get`:
    from protocol 4 the unpickler follows dotted names, so an allow-list that checks only a
    name's prefix hands out the builtins' `exec`, and the pickle runs `touch <marker>` through it."""
    import io
    import zipfile

    def text(s):  # BINUNICODE
        data = s.encode()
        return b"X" + len(data).to_bytes(4, "little") + data

    pickle_bytes = (b"\x80\x04"  # PROTO 4
                    b"ctorch._utils\n_rebuild_tensor.__builtins__.get\n"  # GLOBAL: builtins dict's get
                    + b"(" + text("exec") + b"tR"  # get("exec")
                    + b"(" + text(f"import os; os.system(\"touch '{marker}'\")") + b"tR0"  # exec(...), popped
                    + b"}" + text("model") + b"}s.")  # {"model": {}}
    plain = io.BytesIO()
    torch.save({"model": {}}, plain)
    with zipfile.ZipFile(io.BytesIO(plain.getvalue())) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            dst.writestr(info, pickle_bytes if info.filename.endswith("/data.pkl") else data)
