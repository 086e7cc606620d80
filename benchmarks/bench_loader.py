"""Training batches read from a cold disk: roberta_fast's loader against a plain np.memmap reader.

    python benchmarks/bench_loader.py --quick                      # 256 MB of ids, seconds
    python benchmarks/bench_loader.py --gb 2 --json results/loader-cold-<machine>.json
    python benchmarks/bench_loader.py --dir /mnt/nfs/tmp --gb 8    # the disk the corpus lives on

A pretraining corpus larger than the page cache (or any corpus in its first epoch) is read
from the disk: each shuffled sample is ~1 KB (512 uint16 ids) at a random place. What is
measured, on one synthetic dataset (random ids in one shard, documents of 1,000 tokens) and
the same shuffled sample indices, contenders interleaved per trial, the file's pages dropped
from the page cache (posix_fadvise DONTNEED) before each cold read:
- `np.memmap`: a plain memory map sliced per sample (what nanoGPT-style loaders and this
  loader before MADV_RANDOM / MADV_WILLNEED did): each sample's first touch faults, and the
  kernel reads the disk's read-ahead window around it, one sample after another.
- `roberta_fast`: PretrainingDataset.batch (mode full and doc, packed): MADV_RANDOM maps,
  then MADV_WILLNEED for all the batch's samples before reading them.
Both build the same (B, S) int64 ids; the figures are milliseconds per batch (median over
trials), cold and warm (the same batch again, cached). The record also holds the device's
read_ahead_kb and the latency of one cold 4-KB pread, which decide the gap: a disk with
large read-ahead (RAID, network and some cloud volumes) or high latency (network storage)
gains most.

Measured on: the 2-core CI machine's virtio disk (read_ahead_kb 8192), a CPU run; the
figures depend on the disk, so record them where the corpus lives.
"""
import argparse
import functools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as bc  # noqa: E402

SEQ_LEN, DOC_TOKENS = 512, 1000


def make_dataset(root: Path, tokens: int) -> Path:
    """A valid dataset directory (a tiny preprocess run for its tokenizer and manifest) whose
    train split is then replaced by `tokens` random ids in one shard."""
    from roberta_fast import RobertaTokenizer
    from roberta_fast.corpus import iter_documents
    from roberta_fast.preprocess import preprocess

    corpus = list(iter_documents(max_bytes=20_000))
    tok = RobertaTokenizer.train_from_iterator(corpus, vocab_size=1000)
    (root / "docs.txt").write_text("\n\n".join(corpus))
    out = root / "ds"
    preprocess([root / "docs.txt"], tok, out, valid_fraction=0.0, progress=False, log=lambda m: None)
    manifest = json.loads((out / "manifest.json").read_text())
    shard = manifest["splits"]["train"]["shards"][0]
    ids = np.memmap(out / shard["bin"], dtype=np.uint16, mode="w+", shape=(tokens,))
    rng = np.random.default_rng(0)
    for at in range(0, tokens, 1 << 26):
        ids[at: at + (1 << 26)] = rng.integers(4, 999, size=min(1 << 26, tokens - at), dtype=np.uint16)
    starts = np.arange(0, tokens, DOC_TOKENS, dtype=np.int64)
    ids[starts[1:] - 1] = manifest["eos_id"]  # each document ends with </s>
    ids.flush()
    del ids
    np.save(out / shard["idx"], np.append(starts, tokens))
    shard.update(tokens=tokens, documents=len(starts), bin_bytes=2 * tokens, max_id=998,
                 idx_bytes=(out / shard["idx"]).stat().st_size)
    for key in ("bin_sha256", "idx_sha256"):
        shard.pop(key, None)
    manifest["splits"]["train"].update(tokens=tokens, documents=len(starts))
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def drop_from_page_cache(file: Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_ahead_kb(file: Path):
    """The read-ahead window of the block device holding `file` (Linux), else None."""
    dev = os.stat(file).st_dev
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (base / "queue", base / ".." / "queue"):  # a whole disk, or a partition's disk
        try:
            return int((queue / "read_ahead_kb").read_text())
        except (OSError, ValueError):
            pass
    return None


def cold_pread_ms(file: Path, n: int = 200) -> float:
    """Median latency of one 4-KB read at a random place of the file, not cached."""
    drop_from_page_cache(file)
    size, times = file.stat().st_size, []
    fd = os.open(file, os.O_RDONLY)
    try:
        for _ in range(n):
            at = random.randrange(0, size - 4096) // 4096 * 4096
            start = time.perf_counter()
            os.pread(fd, 4096, at)
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        os.close(fd)
    return statistics.median(times)


def memmap_batch(ids: np.ndarray, indices) -> np.ndarray:
    """The peer: (B, S) int64 rows of `<s>` + S-1 ids sliced from a plain memory map."""
    step = SEQ_LEN - 1
    out = np.ones((len(indices), SEQ_LEN), dtype=np.int64)  # <pad> = 1
    out[:, 0] = 0
    for row, i in enumerate(indices):
        part = ids[i * step: (i + 1) * step]
        out[row, 1: 1 + len(part)] = part
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=2.0, help="size of the synthetic shard (default 2 GB)")
    p.add_argument("--batch", type=int, default=64, help="samples per batch (default 64)")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--dir", help="where to write the dataset (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="256 MB, 3 trials")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    if args.quick:
        args.gb, args.trials = 0.25, 3
    from roberta_fast.data import PretrainingDataset, permute

    work = Path(tempfile.mkdtemp(prefix="bench_loader-", dir=args.dir))
    try:
        tokens = int(args.gb * 1e9) // 2
        free = shutil.disk_usage(work).free
        if free < 2 * tokens + (64 << 20):
            raise SystemExit(f"error: {work} has {free / 1e9:.1f} GB free; --gb {args.gb} needs more")
        data = make_dataset(work, tokens)
        file = data / "train" / "00000.bin"
        contenders = {
            "np.memmap": lambda: functools.partial(memmap_batch, np.memmap(file, dtype=np.uint16, mode="r")),
            "roberta_fast full": lambda: PretrainingDataset(data, seq_len=SEQ_LEN, mode="full").batch,
            "roberta_fast doc packed": lambda: PretrainingDataset(data, seq_len=SEQ_LEN, mode="doc",
                                                                   pack=True).batch,
        }
        n_samples = tokens // (SEQ_LEN - 1)
        n_packed = len(PretrainingDataset(data, seq_len=SEQ_LEN, mode="doc", pack=True))
        times = {name: {"cold": [], "warm": []} for name in contenders}
        for trial in range(args.trials):
            for name, make in contenders.items():
                reader = make()  # fresh maps: none of the file's pages mapped by an earlier trial
                positions = np.arange(args.batch, dtype=np.int64) + args.batch * (trial * len(contenders) + 1)
                indices = permute(positions, n_samples, seed=len(name), epoch=trial)  # fresh places each time
                if "packed" in name:  # packed rows are ~ as many as full rows here: keep indices in range
                    indices = indices % n_packed
                drop_from_page_cache(file)
                for kind in ("cold", "warm"):
                    start = time.perf_counter()
                    reader(indices)
                    times[name][kind].append((time.perf_counter() - start) * 1e3)
                del reader
        rows = []
        peer = statistics.median(times["np.memmap"]["cold"])
        for name, t in times.items():
            cold = statistics.median(t["cold"])
            rows.append({"contender": name, "cold ms": bc.sig(cold), "warm ms": bc.sig(statistics.median(t["warm"])),
                         "cold speed-up": bc.sig(peer / cold)})
        facts = {"read_ahead_kb": read_ahead_kb(file), "cold_4kb_pread_ms": bc.sig(cold_pread_ms(file)),
                 "gb": args.gb, "batch": args.batch, "seq_len": SEQ_LEN, "trials": args.trials}
        print(f"{args.batch} x {SEQ_LEN} ids per batch from {args.gb} GB; {facts}")
        bc.print_rows(rows, ["contender", "cold ms", "warm ms", "cold speed-up"])
        if args.json:
            import torch

            bc.write_json(args.json, bc.environment(torch.device("cpu")), rows, facts=facts)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
