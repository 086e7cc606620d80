"""mask_tokens (on the batch's device) against transformers'
DataCollatorForLanguageModeling on a 256 x 512 batch of roberta-base ids.

Contenders: rf.mask_tokens on the device for each strategy (token, whole_word,
span), span with return_spans=True (the span boundaries the SBO needs: the
difference is their cost), and token on the CPU; the HF collator called as a trainer calls it (a list of
examples in, padded and masked tensors out) and its masking alone
(`torch_mask_tokens` with a precomputed special-tokens mask). Reported: ms per
batch and the speed-up of each contender over the full HF collator call. Target
(issue 4): rf token masking on the GPU >= 100x the HF collator.

    python benchmarks/bench_mask_tokens.py           # GPU: recorded in results/
    python benchmarks/bench_mask_tokens.py --quick   # any machine, 16 x 128
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as bc  # noqa: E402

import roberta_fast as rf  # noqa: E402

VOCAB, PAD, MASK = 50265, 1, 50264


def make_batch(rows, seqlen, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB - 1, (rows, seqlen), generator=g)
    ids[:, 0], ids[:, -1] = 0, 2
    starts = torch.rand(rows, seqlen, generator=g) < 0.7
    return ids.to(device), starts.to(device)


def hf_collator():
    """DataCollatorForLanguageModeling over a roberta-base-sized word-level tokenizer
    (no download: the vocabulary is synthetic, the special ids are roberta's)."""
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": MASK}
    vocab.update({f"w{i}": i for i in range(4, MASK)})
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "<unk>")),
                                  bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", mask_token="<mask>", cls_token="<s>",
                                  sep_token="</s>")
    return DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.15)


def main():
    args = bc.parser(__doc__.splitlines()[0]).parse_args()
    device = bc.default_device()
    rows, seqlen = (16, 128) if args.quick else (256, 512)
    ids, starts = make_batch(rows, seqlen, device)
    step = iter(range(1 << 30))
    runs = {}
    for strategy in ("token", "whole_word", "span"):
        runs[f"rf-{device.type}-{strategy}"] = (
            lambda s=strategy: rf.mask_tokens(ids, seed=0, step=next(step), strategy=s,
                                              word_starts=starts))
    runs[f"rf-{device.type}-span+spans"] = lambda: rf.mask_tokens(
        ids, seed=0, step=next(step), strategy="span", word_starts=starts, return_spans=True)
    if device.type != "cpu":
        ids_cpu = ids.cpu()
        runs["rf-cpu-token"] = lambda: rf.mask_tokens(ids_cpu, seed=0, step=next(step))
    try:
        collator = hf_collator()
        examples = [{"input_ids": row} for row in ids.cpu().tolist()]
        special = (ids.cpu() < 4) | (ids.cpu() == MASK)
        runs["hf-collator"] = lambda: collator(examples)
        runs["hf-torch_mask_tokens"] = lambda: collator.torch_mask_tokens(ids.cpu().clone(),
                                                                          special.clone())
    except Exception as err:  # transformers missing or changed: say so, time the rest
        print(f"hf contenders skipped: {type(err).__name__}: {err}")
    times = {name: bc.bench_ms(fn, device) for name, fn in runs.items()}
    peer = times.get("hf-collator")
    table = [{"impl": name, "batch": f"{rows}x{seqlen}", "ms": bc.sig(ms),
              "x_vs_hf_collator": bc.sig(peer / ms) if peer else None}
             for name, ms in times.items()]
    bc.print_rows(table, ["impl", "batch", "ms", "x_vs_hf_collator"])
    path = bc.record_path(args, "mask_tokens", device)
    if path:
        bc.write_json(path, bc.environment(device), table, targets={"x_vs_hf_collator": 100.0})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
