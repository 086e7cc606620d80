"""Preprocessing throughput: roberta_fast.preprocess against a plain transformers loop, and per
input format against Hugging Face `datasets`.

    python benchmarks/bench_preprocess.py --quick            # ~1 MB, seconds, any machine
    python benchmarks/bench_preprocess.py --mb 64 --json results/preprocess-<machine>.json
    python benchmarks/bench_preprocess.py --tokenizer DIR    # e.g. roberta-base's files
    python benchmarks/bench_preprocess.py --formats-only --mb 16 --json results/preprocess-formats-<machine>.json

What is measured, on the same files in the same run (half .jsonl, half blank-line
separated .txt, made by repeating the embedded corpus up to --mb MB):
- `hf-loop`: a plain loop over the documents calling transformers' RobertaTokenizerFast
  (loaded from the same tokenizer directory) one document at a time, ids kept as numpy
  arrays: what a hand-written script does. The reading and document splitting are
  untimed; only tokenizer calls count, so the peer is favoured.
- `hf-batched`: the same tokenizer called on batches of 1,000 documents (Rust-parallel).
- `roberta_fast wN`: `python -m roberta_fast.preprocess` with N worker processes, end to
  end (reading, splitting, tokenizing, writing the shards and the manifest), for N from 1
  to all cores: MB/s of input text, the speed-up over hf-loop, and the scaling over N=1.
- peak memory: preprocess with one worker, in a fresh process, on 1/4, 1/2, 1 and 2
  times the corpus: its peak RSS (VmHWM), which is what each worker of a parallel run
  holds. It should stay flat as the corpus grows (streaming, fixed-size chunks).
- formats: the same documents as one plain .jsonl, as .jsonl.gz / .bz2 / .xz / .zst, as Parquet
  (row groups of 1,000 rows) and as a `datasets` save_to_disk directory (Arrow), each
  preprocessed end to end with all cores in a fresh process: MB/s of the uncompressed text
  (the documents' UTF-8 bytes, the same for every row), tokens/s, and peak RSS (the largest of
  the main process and its workers, VmHWM), also at half the corpus: flat as the corpus grows. The peer, in the same run: `datasets`'
  `load_dataset("json", ...)` of the plain file (a fresh cache) + `map(batched=True,
  num_proc=2)` with transformers' tokenizer loaded from the same directory, also in a fresh
  process (its Arrow output written to its cache, as datasets does). Every row must produce the
  same number of tokens, or the run fails.
The tokenizer is trained on the corpus (vocab 8192; --quick 2000) unless --tokenizer is given; BPE
speed depends on the vocabulary, so compare figures only within one run.

Measured on: the 2-core CI machine for --quick only (a smoke test, the figures mean
little there); record real figures on a many-core machine.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from roberta_fast import RobertaTokenizer
from roberta_fast.corpus import iter_documents
from roberta_fast.preprocess import preprocess

if __name__ == "__main__":  # not in spawned workers, which re-import this file: _common imports torch (slow)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _common as bc


def make_corpus(directory: Path, docs: list[str], mb: float, n_files: int = 4) -> list[Path]:
    """Files of about `mb` MB in all: `docs` repeated, half .jsonl, half .txt."""
    target, written, files = mb * 1e6, 0, []
    handles = []
    for k in range(n_files):
        path = directory / (f"part{k}.jsonl" if k % 2 == 0 else f"part{k}.txt")
        files.append(path)
        handles.append(open(path, "w", encoding="utf-8"))
    i = 0
    while written < target:
        doc = docs[i % len(docs)]
        f = handles[i % n_files]
        if f.name.endswith(".jsonl"):
            line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
        else:
            line = re.sub(r"\n\s*\n", "\n", doc) + "\n\n"  # a blank line would split it
        f.write(line)
        written += len(line.encode("utf-8"))
        i += 1
    for f in handles:
        f.close()
    return files


def read_documents(files: list[Path]) -> list[str]:
    """The documents of the files, split as preprocess splits them (untimed, for the peer)."""
    docs = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            docs += [json.loads(line)["text"] for line in text.splitlines() if line.strip()]
        else:
            docs += [d for d in re.split(r"\n[ \t\r\f\v]*\n", text) if d.strip()]
    return docs


def time_hf(tok_dir: Path, docs: list[str], nbytes: int) -> list[dict]:
    """hf-loop and hf-batched rows."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir), model_max_length=1 << 60, split_special_tokens=True)
    rows = []
    start = time.perf_counter()
    ids = [np.asarray(hf(d)["input_ids"], dtype=np.uint32) for d in docs]
    loop = time.perf_counter() - start
    rows.append({"impl": "hf-loop", "workers": 1, "s": loop, "tokens": int(sum(map(len, ids)))})
    start = time.perf_counter()
    n = 0
    for a in range(0, len(docs), 1000):
        n += sum(len(x) for x in hf(docs[a:a + 1000])["input_ids"])
    rows.append({"impl": "hf-batched", "workers": os.cpu_count(), "s": time.perf_counter() - start, "tokens": n})
    for r in rows:  # stored documents carry </s> but not <s>: count as the shards do
        r["tokens"] -= len(docs)
    for r in rows:
        r["MB/s"] = bc._sig(nbytes / r["s"] / 1e6)
    return rows


def time_ours(files, tok, work: Path, workers: int, shard_mb: float, nbytes: int) -> dict:
    out = work / f"out-w{workers}"
    start = time.perf_counter()
    m = preprocess(files, tok, out, workers=workers, shard_mb=shard_mb, progress=False, log=lambda s: None)
    s = time.perf_counter() - start
    tokens = m["splits"]["train"]["tokens"] + m["splits"]["valid"]["tokens"]
    return {"impl": f"roberta_fast w{workers}", "workers": workers, "s": s, "tokens": tokens,
            "MB/s": bc._sig(nbytes / s / 1e6)}


_MEASURE = """
import json, resource, sys
from roberta_fast.preprocess import preprocess
preprocess(sys.argv[1:-3], sys.argv[-3], sys.argv[-2], shard_mb=float(sys.argv[-1]), workers=1, progress=False,
           log=lambda s: None)
try:  # VmHWM: this process's own peak (ru_maxrss may include the parent's, inherited across exec)
    line = next(li for li in open("/proc/self/status") if li.startswith("VmHWM:"))
    peak = int(line.split()[1]) / 1024
except OSError:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"peak_mb": peak}))
"""


def peak_memory(work: Path, docs: list[str], tok_dir: Path, mb: float, shard_mb: float) -> dict:
    """Peak RSS of a fresh single-process preprocess run (what each worker holds) on an `mb` MB corpus."""
    d = work / f"mem{mb}"
    d.mkdir()
    files = make_corpus(d, docs, mb)
    cmd = [sys.executable, "-c", _MEASURE, *map(str, files), str(tok_dir), str(d / "out"), str(shard_mb)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    peak = json.loads(res.stdout.strip().splitlines()[-1])
    return {"corpus_mb": bc._sig(mb), "peak_rss_mb": bc._sig(peak["peak_mb"])}


# ----------------------------------------------------------------------------- formats
_PEAK = """
def peak_rss_mb():
    import resource
    try:  # VmHWM: this process's own peak; the workers' (children) from getrusage
        line = next(li for li in open("/proc/self/status") if li.startswith("VmHWM:"))
        own = int(line.split()[1]) / 1024
    except OSError:
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
"""

_OURS = _PEAK + """
import json, sys, time
from roberta_fast.preprocess import preprocess
if __name__ == "__main__":
    source, tok, out = sys.argv[1:4]
    start = time.perf_counter()
    m = preprocess([source], tok, out, shard_mb=float(sys.argv[4]), progress=False, log=lambda s: None)
    s = time.perf_counter() - start
    tokens = m["splits"]["train"]["tokens"] + m["splits"]["valid"]["tokens"]
    print(json.dumps({"s": s, "tokens": tokens, "documents": m["counts"]["documents"], "peak_rss_mb": peak_rss_mb()}))
"""

_DATASETS = _PEAK + """
import json, sys, time
if __name__ == "__main__":
    source, tok_dir, cache = sys.argv[1:4]
    start = time.perf_counter()
    import datasets
    from transformers import AutoTokenizer
    datasets.disable_progress_bars()
    hf = AutoTokenizer.from_pretrained(tok_dir, model_max_length=1 << 60, split_special_tokens=True)
    ds = datasets.load_dataset("json", data_files=source, split="train", cache_dir=cache)
    ids = ds.map(lambda batch: {"input_ids": hf(batch["text"])["input_ids"]}, batched=True, num_proc=2,
                 remove_columns=ds.column_names)
    s = time.perf_counter() - start
    tokens = sum(len(x) for batch in ids.with_format("arrow").iter(10_000) for x in batch["input_ids"].to_pylist())
    print(json.dumps({"s": s, "tokens": tokens - len(ids), "documents": len(ids), "peak_rss_mb": peak_rss_mb()}))
"""


def write_formats(directory: Path, docs: list[str], mb: float) -> dict:
    """The documents repeated to about `mb` MB, as one file (or directory) per format."""
    import bz2, gzip, lzma  # noqa: E401
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts, n = [], 0
    while n < mb * 1e6:
        texts.append(docs[len(texts) % len(docs)])
        n += len(texts[-1].encode("utf-8"))
    plain = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts).encode("utf-8")
    paths = {"jsonl": directory / "docs.jsonl"}
    paths["jsonl"].write_bytes(plain)
    for name, compress in (("jsonl.gz", lambda b: gzip.compress(b, 6)), ("jsonl.bz2", bz2.compress),
                           ("jsonl.xz", lzma.compress), ("jsonl.zst", zstandard.ZstdCompressor(level=3).compress)):
        paths[name] = directory / f"docs.{name}"
        paths[name].write_bytes(compress(plain))
    paths["parquet"] = directory / "docs.parquet"
    pq.write_table(pa.table({"text": texts}), paths["parquet"], row_group_size=1000)
    paths["datasets dir (arrow)"] = directory / "saved"
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(paths["datasets dir (arrow)"]))
    return {"paths": paths, "text_bytes": n, "documents": len(texts)}


def _fresh_process(script: str, args: list) -> dict:
    res = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"a benchmark process failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def time_formats(work: Path, docs: list[str], tok_dir: Path, mb: float, shard_mb: float, quick: bool) -> list[dict]:
    """One row per format and one for the datasets peer (see the module docstring; --quick: no half-size runs)."""
    half = work / "formats-half"  # the same at half the size: peak RSS only, to see that it stays flat
    half.mkdir()
    made_half = write_formats(half, docs, mb / 2) if not quick else None
    d = work / "formats"
    d.mkdir()
    made = write_formats(d, docs, mb)
    rows = []
    for name, path in made["paths"].items():
        small = None if quick else \
            _fresh_process(_OURS, [made_half["paths"][name], tok_dir, half / f"out-{name.split()[0]}", shard_mb])
        r = _fresh_process(_OURS, [path, tok_dir, d / f"out-{name.split()[0]}", shard_mb])
        size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() else path.stat().st_size
        rows.append({"impl": f"roberta_fast {name}", "input_mb": bc.sig(size / 1e6),
                     "peak_rss_mb_half_corpus": small and bc.sig(small["peak_rss_mb"]), **r})
    peer = _fresh_process(_DATASETS, [made["paths"]["jsonl"], tok_dir, d / "hf-cache"])
    rows.append({"impl": "datasets jsonl (load_dataset + map num_proc=2)",
                 "input_mb": bc.sig(made["paths"]["jsonl"].stat().st_size / 1e6), **peer})
    plain, hf = rows[0]["s"], rows[-1]["s"]
    for r in rows:
        r["text_MB/s"] = bc.sig(made["text_bytes"] / r["s"] / 1e6)
        r["tokens/s"] = bc.sig(r["tokens"] / r["s"])
        r["x_vs_plain"] = bc.sig(plain / r["s"])
        r["x_vs_datasets"] = bc.sig(hf / r["s"])
        r["s"], r["peak_rss_mb"] = bc.sig(r["s"]), bc.sig(r["peak_rss_mb"])
    if len({(r["tokens"], r["documents"]) for r in rows}) != 1:
        raise SystemExit(f"token counts differ between formats: {[(r['impl'], r['tokens']) for r in rows]}")
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets: compressed within 15% of the plain file's speed; every format >= 1.5x datasets."""
    out = []
    for r in rows:
        if not r["impl"].startswith("roberta_fast"):
            continue
        if any(r["impl"].endswith(ext) for ext in (".gz", ".bz2", ".xz", ".zst")):
            out.append({"impl": r["impl"], "metric": "x_vs_plain", "target": 0.85, "achieved": r["x_vs_plain"],
                        "status": "met" if r["x_vs_plain"] >= 0.85 else "missed"})
        out.append({"impl": r["impl"], "metric": "x_vs_datasets", "target": 1.5, "achieved": r["x_vs_datasets"],
                    "status": "met" if r["x_vs_datasets"] >= 1.5 else "missed"})
    return out


def main():
    p = bc.parser(__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=64.0, help="corpus size in MB (default 64; --quick: 1)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: one trained on the corpus)")
    p.add_argument("--formats-only", action="store_true", help="only the per-format rows against datasets")
    p.add_argument("--note", default="", help="a note kept in the JSON record (e.g. what else ran on the machine)")
    args = p.parse_args()
    mb = 1.0 if args.quick else args.mb
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    worker_counts = sorted({1, cores} | {w for w in (2, 4, 8, 16, 32) if w < cores})
    shard_mb = max(mb / (4 * cores), 0.05)  # enough chunks for every worker count
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "corpus").mkdir()
        docs = list(iter_documents(max_bytes=int(min(mb, 2.0) * 1e6)))
        files = make_corpus(work / "corpus", docs, mb)
        nbytes = sum(f.stat().st_size for f in files)
        if args.tokenizer:
            tok = RobertaTokenizer.from_pretrained(args.tokenizer)
        else:
            tok = RobertaTokenizer.train_from_iterator(docs, vocab_size=2000 if args.quick else 8192)
        tok_dir = tok.save(work / "tok")
        formats = time_formats(work, docs, tok_dir, mb, shard_mb, args.quick)
        print(f"formats: the same {formats[0]['documents']} documents, {cores} cores")
        bc.print_rows(formats, ["impl", "input_mb", "s", "text_MB/s", "tokens/s", "peak_rss_mb",
                                "peak_rss_mb_half_corpus", "x_vs_plain", "x_vs_datasets", "tokens"])
        goals = targets(formats)
        for g in goals:
            print(f"  target {g['impl']} {g['metric']} >= {g['target']}: {g['achieved']} ({g['status']})")

        def write(rows, memory):
            """The record so far: written after each section, so a run cut off keeps what it measured."""
            if args.json:
                import torch

                bc.write_json(args.json, bc.environment(torch.device("cpu")), rows, memory=memory, formats=formats,
                              targets=goals, note=args.note,
                              config={"mb": mb, "cores": cores, "shard_mb": shard_mb, "vocab_size": tok.vocab_size})

        write([], [])  # the formats first
        if not args.formats_only:
            write(*others(args, work, docs, files, tok, tok_dir, nbytes, mb, shard_mb, worker_counts, cores))


def others(args, work, docs, files, tok, tok_dir, nbytes, mb, shard_mb, worker_counts, cores):
    """The hf-loop / hf-batched / worker-scaling rows and the peak memory by corpus size."""
    rows = time_hf(tok_dir, read_documents(files), nbytes)
    rows += [time_ours(files, tok, work, w, shard_mb, nbytes) for w in worker_counts]
    loop = rows[0]["s"]
    single = next(r["s"] for r in rows if r["impl"] == "roberta_fast w1")
    for r in rows:
        r["x_vs_hf_loop"] = bc._sig(loop / r["s"])
        r["x_vs_w1"] = bc._sig(single / r["s"]) if r["impl"].startswith("roberta_fast") else ""
        r["s"] = bc._sig(r["s"])
    if len({r["tokens"] for r in rows}) != 1:  # every contender must have done the same work
        raise SystemExit(f"token counts differ between contenders: {[(r['impl'], r['tokens']) for r in rows]}")
    print(f"corpus: {nbytes / 1e6:.1f} MB in {len(files)} files, vocab {tok.vocab_size}, {cores} cores")
    bc.print_rows(rows, ["impl", "workers", "s", "MB/s", "x_vs_hf_loop", "x_vs_w1", "tokens"])
    sizes = [mb / 4, mb / 2, mb] if args.quick else [mb / 4, mb / 2, mb, 2 * mb]
    memory = [peak_memory(work, docs, tok_dir, s, shard_mb) for s in sizes]
    print("\npeak memory of a fresh --workers 1 process (flat as the corpus grows):")
    bc.print_rows(memory, ["corpus_mb", "peak_rss_mb"])
    return rows, memory


if __name__ == "__main__":
    main()
