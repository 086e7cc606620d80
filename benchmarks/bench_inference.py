"""Benchmark: encoder inference on mixed-length batches, roberta_fast against transformers.

    python benchmarks/bench_inference.py [--quick] [--json PATH] [--skip-compile]

The drop-in case (issue 8): batches of 32 sentences whose lengths are drawn uniformly
between 8 and 512 tokens, right-padded to the longest, through roberta-base's encoder
(random weights) in bf16 on a GPU. Tokens/s counts real tokens only, so running the
padding is not counted as work. Contenders on the same weights in the same run:
  rf-fused      roberta_fast.RobertaModel, fused kernels, padded batches run unpadded
  rf-reference  roberta_fast.RobertaModel, plain PyTorch
  hf-patched    transformers RobertaModel after roberta_fast.patch(model)
  hf-sdpa       transformers RobertaModel, attn_implementation="sdpa" (the peer; ratios are to it)
  hf-eager      transformers RobertaModel, attn_implementation="eager"
  hf-compile    hf-sdpa under torch.compile (skipped with --skip-compile)
Target on a GPU: rf-fused >= 2x hf-sdpa. --quick: a tiny model and short lengths,
fp32 on the CPU (the fused contenders under the Triton interpreter).
"""
import copy
import os
import time

import torch

import _common as bc

bc.use_interpreter_without_gpu()
import roberta_fast as rf  # noqa: E402  (after the interpreter switch)


def batches(count, batch_size, low, high, vocab, seed=0):
    """`count` (input_ids, attention_mask) batches of right-padded random sentences."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(low, high + 1, (batch_size,), generator=g)
        longest = int(lengths.max())
        ids = torch.randint(3, vocab, (batch_size, longest), generator=g)
        mask = torch.arange(longest)[None] < lengths[:, None]
        ids[~mask] = 1
        ids[:, 0] = 0
        out.append((ids, mask.long()))
    return out


def contenders(cfg, device, dtype, skip_compile):
    """name -> callable(ids, mask), or name -> reason it cannot run."""
    import transformers

    hf_config = transformers.RobertaConfig(**cfg.to_dict())
    torch.manual_seed(0)
    sdpa = transformers.RobertaModel(hf_config).eval().to(device, dtype)
    sdpa.set_attn_implementation("sdpa")
    eager = copy.deepcopy(sdpa)
    eager.set_attn_implementation("eager")
    runs = {"hf-sdpa": lambda ids, mask: sdpa(input_ids=ids, attention_mask=mask).last_hidden_state,
            "hf-eager": lambda ids, mask: eager(input_ids=ids, attention_mask=mask).last_hidden_state}
    fused_ok = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    for backend in ("fused", "reference"):
        if backend == "fused" and not fused_ok:
            runs["rf-fused"] = "the fused kernels need a CUDA GPU (or TRITON_INTERPRET=1)"
            continue
        model = rf.RobertaModel.from_pretrained(sdpa, backend=backend).eval().to(device, dtype)
        model.check_inputs = False
        runs[f"rf-{backend}"] = (lambda m: lambda ids, mask: m(ids, attention_mask=mask).last_hidden_state)(model)
    if fused_ok:
        patched = rf.patch(copy.deepcopy(sdpa))
        runs["hf-patched"] = lambda ids, mask: patched(input_ids=ids, attention_mask=mask).last_hidden_state
    if skip_compile:
        runs["hf-compile"] = "skipped (--skip-compile)"
    else:
        compiled = torch.compile(sdpa, dynamic=True)
        runs["hf-compile"] = lambda ids, mask: compiled(input_ids=ids, attention_mask=mask).last_hidden_state
    return runs


def time_run(fn, data, device, repeats):
    """Median seconds to run every batch of `data` once, after one warm-up pass."""
    def once():
        for ids, mask in data:
            fn(ids, mask)
        if device.type == "cuda":
            torch.cuda.synchronize()
    once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main():
    p = bc.parser(__doc__.splitlines()[0])
    p.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile contender")
    args = p.parse_args()
    device = bc.default_device()
    quick = args.quick or device.type != "cuda"
    if quick:
        cfg = rf.RobertaConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=128, max_position_embeddings=66)
        dtype, shape, repeats = torch.float32, dict(count=2, batch_size=4, low=4, high=64), 1
    else:
        cfg, dtype = rf.RobertaConfig.preset("base"), torch.bfloat16
        shape, repeats = dict(count=8, batch_size=32, low=8, high=512), 5
    data = [(ids.to(device), mask.to(device)) for ids, mask in batches(vocab=cfg.vocab_size, **shape)]
    real_tokens = sum(int(mask.sum()) for _, mask in data)
    padded_tokens = sum(mask.numel() for _, mask in data)
    print(f"device: {bc.device_facts(device)['name']}  dtype: {dtype}  real tokens/pass: {real_tokens} "
          f"(padded to {padded_tokens})")

    results = []
    with torch.inference_mode():
        for name, run in contenders(cfg, device, dtype, args.skip_compile or quick).items():
            if isinstance(run, str):
                results.append({"contender": name, "status": run})
                continue
            seconds = time_run(run, data, device, repeats)
            results.append({"contender": name, "status": "ok", "ms_per_batch": bc.sig(1e3 * seconds / len(data)),
                            "tokens_per_s": bc.sig(real_tokens / seconds)})
    peer = next((r["tokens_per_s"] for r in results if r["contender"] == "hf-sdpa"), None)
    for r in results:
        if r["status"] == "ok" and peer:
            r["vs_hf_sdpa"] = bc.sig(r["tokens_per_s"] / peer)
    bc.print_rows(results, ["contender", "status", "ms_per_batch", "tokens_per_s", "vs_hf_sdpa"])
    if args.json:
        bc.write_json(args.json, bc.environment(device), results, config=dict(shape, dtype=str(dtype)),
                      target={"rf-fused vs hf-sdpa": 2.0})


if __name__ == "__main__":
    main()
