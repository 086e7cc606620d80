"""Benchmark: encoder inference on mixed-length batches, roberta_fast against transformers and ONNX Runtime.

    python benchmarks/bench_inference.py [--device cpu|cuda] [--quick] [--json PATH] [--skip-compile]
                                         [--lengths uniform,corpus] [--dtypes fp32,bf16] [--batches N] [--repeats N]
                                         [--only rf-unpadded,...] [--chart PATH]
                                         [--batch-size N] [--fixed-length N] [--head encoder|mlm]

The drop-in case (issues 8 and 18): batches of 32 sequences, right-padded to the longest,
through roberta-base's encoder (random weights). Lengths: "uniform" in 8..512, "corpus",
drawn from the token counts of the embedded corpus's documents (roberta_fast.corpus,
truncated at 512 as a tokenizer would), or "fixed": every sequence 128 tokens, nothing
padded (the no-regression case). Tokens/s counts real tokens only, so running the
padding is not counted as work. Contenders on the same weights, timed interleaved (one
pass over the batches each in turn, median of --repeats, after one warm-up pass):
  on the CPU (issue 18)
    rf-unpadded   roberta_fast.RobertaModel under inference_mode: padding dropped at the embeddings
    rf-padded     the same model with unpad = False (the padded reference path)
    rf-unpadded-whole  rf-unpadded with cpu_group_tokens = None: a batch of over 1024 tokens runs whole,
                  not in groups of rows (RobertaModel.encode)
    rf-compile    rf-unpadded under torch.compile(dynamic=True); `graphs` counts its compiled
                  graphs after the warm-up and after the timed passes (equal: no recompile per shape)
    onnxruntime   the encoder exported with torch.onnx.export (dynamic batch and length), CPU provider
    rf-prepacked  rf-unpadded after roberta_fast.prepack(model): fp32, the Linear weights packed once by oneDNN
    rf-fp16-weights  rf-unpadded after roberta_fast.quantize(model, dtype=torch.float16): fp16 Linear weights,
                  fp32 activations and sums (fbgemm's fp16-weight GEMM)
  int8 on the CPU (issue 30; `weights_mb`: the process's RSS growth while the contender's model was built)
    rf-int8       rf-unpadded after roberta_fast.quantize(model): int8 Linear layers (oneDNN, the default engine;
                  8-bit activations where the CPU sums them exactly, VNNI or AMX, else 7: `rf_int8_activation_bits`)
    rf-int8-7bit  the same with activation_bits=7 (the default on CPUs without VNNI; on others, an export for them)
    rf-int8-whole  rf-int8 with cpu_group_tokens = None (batches run whole, as rf-unpadded-whole)
    rf-int8-fbgemm    the same with engine="fbgemm" (PyTorch's quantized Linear on fbgemm, for comparison)
    rf-int8-auto  the same with engine="auto": both packings, fbgemm for calls of few tokens, oneDNN for the rest
    onnxruntime-int8  that ONNX export through onnxruntime.quantization.quantize_dynamic (its defaults; --head mlm:
                  its MatMuls only, the tied decoder's table stored transposed so it is an int8 matmul too)
    onnxruntime-int8-7bit  the same with reduce_range=True (7-bit weights): ONNX Runtime's advice for its
                  u8s8 int8 on CPUs without VNNI, where the defaults' products can saturate (bench_cpu_linear.py)
    rf-int8-onnxruntime  rf-int8's model exported with roberta_fast.quantization.onnx_translation_table()
                  (ONNX's integer matmuls, rf-int8's numerics) in the same onnxruntime session setup
    hf-int8       transformers' RobertaModel (SDPA) after torch.ao.quantization.quantize_dynamic of its nn.Linear
  on a GPU (issue 8)
    rf-fused      fused kernels, padded batches run unpadded;  rf-reference  plain PyTorch
    hf-patched    transformers RobertaModel after roberta_fast.patch(model)
  both
    hf-sdpa       transformers RobertaModel, attn_implementation="sdpa" (the peer; ratios are to it)
    hf-eager      transformers RobertaModel, attn_implementation="eager"
    hf-compile    hf-sdpa under torch.compile(dynamic=True)
Per contender: ms per batch, real tokens/s, the ratio to hf-sdpa, peak RSS (the process's
high-water mark while it ran, every model loaded; CPU), the page faults and system CPU time
per batch (CPU: fresh memory from the OS, see docs/inference.md, "The allocator") and max
|difference| to transformers fp32 over real positions. Targets: on a GPU rf-fused >= 2x
hf-sdpa; on the CPU rf-unpadded >= 1.6x hf-sdpa and >= 1.0x onnxruntime on the uniform mix,
at <= 1e-5 fp32 difference, and >= 1.0x hf-sdpa on fixed lengths; int8 (issue 30): rf-int8
>= 1.8x hf-sdpa and >= 1.0x onnxruntime-int8 (its defaults and its 7-bit setting) on fixed
lengths, >= 3x hf-sdpa on the uniform mix; the record's `targets` says met / missed / not measured.
--quick (CI): a tiny model, uniform lengths 4..64, fp32, no compile contenders, no onnxruntime-int8-7bit;
its targets read not measured (roberta-base's).
--batch-size 1 --lengths fixed --fixed-length 16 (say): the single-request latency of CPU serving
(the targets above are for batches of 32 and 128 tokens, and are then not measured).
--head mlm: every contender is its framework's RobertaForMaskedLM (the encoder and the MLM head, logits
at every position, as a fill-mask pipeline asks for them); the differences are of the logits, and the
targets (the encoder's) are not measured.
Machine shared with other work? Each row keeps the 1-minute load average after its setting ran.
"""
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

import _common as bc

bc.use_interpreter_without_gpu()
import roberta_fast as rf  # noqa: E402  (after the interpreter switch)
from plot import throughput_chart  # noqa: E402
from roberta_fast.model import CPU_GROUP_TOKENS  # noqa: E402
from roberta_fast.quantization import default_activation_bits, default_engine, onnx_translation_table  # noqa: E402

INT8_CONTENDERS = ("rf-int8", "rf-int8-7bit", "rf-int8-whole", "rf-int8-fbgemm", "rf-int8-auto",
                   "rf-int8-onnxruntime", "onnxruntime-int8", "onnxruntime-int8-7bit", "hf-int8")

# every contender `contenders` can build, for `--only` (a misspelt name is refused, not silently left out)
CONTENDERS = ("hf-sdpa", "hf-eager", "hf-compile", "hf-patched", "rf-fused", "rf-reference", "rf-unpadded",
              "rf-padded", "rf-unpadded-whole", "rf-compile", "onnxruntime", "rf-prepacked", "rf-fp16-weights",
              *INT8_CONTENDERS)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def batches(count, batch_size, low, high, vocab, seed=0, lengths_from=None):
    """`count` (input_ids, attention_mask) batches of right-padded random sentences; lengths uniform in
    [low, high], or drawn from the tensor `lengths_from` when given."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        if lengths_from is None:
            lengths = torch.randint(low, high + 1, (batch_size,), generator=g)
        else:
            lengths = lengths_from[torch.randint(0, len(lengths_from), (batch_size,), generator=g)]
        longest = int(lengths.max())
        ids = torch.randint(3, vocab, (batch_size, longest), generator=g)
        mask = torch.arange(longest)[None] < lengths[:, None]
        ids[~mask] = 1
        ids[:, 0] = 0
        out.append((ids, mask.long()))
    return out


def fixed_lengths(length):
    """Every sequence `length` tokens: batches with nothing padded."""
    return torch.tensor([length])


def corpus_lengths(max_len):
    """Token counts (with <s> and </s>, truncated at max_len) of the embedded corpus's documents."""
    from roberta_fast.corpus import cache_root, default_dataset

    dataset = default_dataset()
    tok = rf.RobertaTokenizer.from_pretrained(dataset / "tokenizer")
    corpus = next(cache_root().glob(dataset.name.split("-vocab")[0].replace("default", "corpus") + ".jsonl"))
    docs = [json.loads(line)["text"] for line in corpus.open(encoding="utf-8")]
    return torch.tensor([len(ids) + 2 for ids in tok.encode_batch(docs)]).clamp(max=max_len)


def hidden(out):
    """The output compared and timed: the MLM logits of a *ForMaskedLM (--head mlm), else the last hidden state."""
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def onnx_int8(path, out, reduce_range=False, tied_decoder=False):
    """onnxruntime's quantize_dynamic (with `reduce_range`) of the ONNX model at `path`, written to `out`.

    `tied_decoder` (an MLM export): its decoder multiplies by Transpose(word embeddings), which quantize_dynamic
    cannot make an integer matmul (its weight is no initializer), and its defaults quantize the table for
    the embedding Gather, leaving a DequantizeLinear of the whole (H, V) table run every request. So the
    transposed table is stored as the decoder's own initializer and only MatMuls are quantized: every
    Linear, the decoder included, is an int8 matmul and the embedding lookup stays fp32."""
    from onnxruntime.quantization import quantize_dynamic

    if tied_decoder:
        import onnx
        from onnx import numpy_helper

        graph_model = onnx.load(path)
        graph = graph_model.graph
        tables = {t.name: t for t in graph.initializer}
        for node in [n for n in graph.node if n.op_type == "Transpose" and n.input[0] in tables]:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            table = numpy_helper.to_array(tables[node.input[0]]).transpose(perm).copy()
            graph.initializer.append(numpy_helper.from_array(table, node.output[0]))
            graph.node.remove(node)
        onnx.save(graph_model, path)
    quantize_dynamic(path, out, reduce_range=reduce_range,  # uint8 activations
                     **({"op_types_to_quantize": ["MatMul"]} if tied_decoder else {}))


def onnx_runner(name, model, example, int8=False, translations=None, reduce_range=False):
    """The rf encoder exported by torch.onnx.export (dynamic batch and length, `translations()` as its
    custom_translation_table) in an onnxruntime CPU session with all graph optimisations, after
    onnx_int8 (with `reduce_range`) when `int8`; a string saying why when it cannot run."""
    try:
        import onnxruntime  # noqa: F401  (bc.onnxruntime_cpu_session's)
    except ImportError:
        return "onnxruntime not installed (pip install -e .[export])"
    ids, mask = example
    reps = (2 if ids.shape[0] < 2 else 1, 2 if ids.shape[1] < 2 else 1)
    ids, mask = ids.repeat(reps), mask.repeat(reps)  # (a --batch-size 1 example: the dims start at 2)
    dims = {0: torch.export.Dim("batch", min=2, max=4096),  # README: min=2 for torch < 2.10, max for 2.6
            1: torch.export.Dim("seqlen", min=2, max=model.config.max_seq_len)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (ids,), kwargs={"attention_mask": mask}, dynamo=True, verbose=False,
                                    dynamic_shapes={"input_ids": dims, "attention_mask": dims},
                                    custom_translation_table=translations and translations())
    with tempfile.TemporaryDirectory(prefix="bench_inference_") as folder:  # ~0.6 GB for roberta-base: not left behind
        path = os.path.join(folder, "encoder.onnx")
        program.save(path)
        if int8:
            onnx_int8(path, path.replace(".onnx", "-int8.onnx"), reduce_range, tied_decoder=hasattr(model, "lm_head"))
            path = path.replace(".onnx", "-int8.onnx")
        session = weighed(name, lambda: bc.onnxruntime_cpu_session(path))  # the session holds the model read in
    names = [i.name for i in session.get_inputs()]

    def run(ids, mask):
        feeds = dict(zip(names, (ids.numpy(), mask.numpy())))
        return torch.from_numpy(session.run(None, feeds)[0])
    return run


HEAD_CLASSES = {"encoder": "RobertaModel", "mlm": "RobertaForMaskedLM"}  # --head -> the class each framework runs


def hf_sdpa(cfg, device, dtype, head="encoder"):
    """transformers' RobertaModel (RobertaForMaskedLM: --head mlm) with SDPA attention; the same random
    weights at every call."""
    import transformers

    torch.manual_seed(0)
    cls = getattr(transformers, HEAD_CLASSES[head])
    model = cls(transformers.RobertaConfig(**cfg.to_dict())).eval().to(device, dtype)
    model.set_attn_implementation("sdpa")
    return model


WEIGHTS_MB = {}  # contender -> the process's RSS growth while its model was built (its weights' memory)


def weighed(name, build):
    """build(), with the process's RSS growth meanwhile recorded as WEIGHTS_MB[name]."""
    gc.collect()
    before = _rss_mb()
    built = build()
    gc.collect()
    WEIGHTS_MB[name] = (_rss_mb() or 0) - (before or 0)
    return built


LINEAR_WEIGHTS_CHILD = """
import json, sys, torch, roberta_fast as rf
from roberta_fast.quantization import LAYER_LINEARS
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
model = rf.RobertaModel(rf.RobertaConfig.from_dict(json.loads(sys.argv[1]))).eval()
fp32 = sum(getattr(layer, name).weight.nbytes + getattr(layer, name).bias.nbytes
           for layer in model.encoder.layer for name in LAYER_LINEARS)
if sys.argv[2] != "fp16":  # rf.quantize's one-off probe of the kernels (their code, not weights) runs first
    rf.quantization.sums_8bit_activations_exactly(sys.argv[2])
before = rss()
if sys.argv[2] == "fp16":
    rf.quantize(model, dtype=torch.float16)
else:
    rf.quantize(model, engine=sys.argv[2])
print(json.dumps({"fp32_mb": fp32 / 2**20, "packed_mb": (fp32 - (before - rss())) / 2**20}))
"""


def linear_weights(cfg, engine):
    """The four Linear layers per block, in MB, fp32 and after rf.quantize(engine=...) (engine "fp16":
    rf.quantize(dtype=torch.float16), keys fp16_*): measured in a fresh process whose allocator
    returns what is freed at once (MALLOC_MMAP_THRESHOLD_), so the RSS drop as the fp32 weights give
    way to the packed ones counts those weights alone; None off Linux."""
    if not os.path.exists("/proc/self/status"):
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # not a run's keep-freed settings
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    child = [sys.executable, "-c", LINEAR_WEIGHTS_CHILD, json.dumps(cfg.to_dict()), engine]
    out = json.loads(subprocess.run(child, capture_output=True, text=True, check=True, env=env).stdout)
    kind = "fp16" if engine == "fp16" else "int8"
    return {"engine": "fbgemm" if engine == "fp16" else engine, "fp32_mb": bc.sig(out["fp32_mb"]),
            f"{kind}_mb": bc.sig(out["packed_mb"]), f"{kind}_vs_fp32": bc.sig(out["packed_mb"] / out["fp32_mb"])}


def torch_dynamic_int8(model):
    """PyTorch's dynamic quantization of every nn.Linear (torch.ao.quantization, deprecated but present)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def contenders(cfg, device, dtype, skip_compile, example, wanted=lambda name: True, head="encoder"):
    """name -> callable(ids, mask) -> last hidden state (MLM logits: head "mlm"), or name -> the reason
    it cannot run; the costlier ones (an ONNX export, a second model) are built only when `wanted(name)`."""
    import transformers  # noqa: F401  (imported before weighing the first model)

    sdpa = weighed("hf-sdpa", lambda: hf_sdpa(cfg, device, dtype, head))
    runs = {"hf-sdpa": lambda ids, mask: hidden(sdpa(input_ids=ids, attention_mask=mask))}
    if wanted("hf-eager"):
        eager = copy.deepcopy(sdpa)
        eager.set_attn_implementation("eager")
        runs["hf-eager"] = lambda ids, mask: hidden(eager(input_ids=ids, attention_mask=mask))

    def ours(backend, unpad=True, cpu_group_tokens=CPU_GROUP_TOKENS):
        model = getattr(rf, HEAD_CLASSES[head]).from_pretrained(sdpa, backend=backend).eval().to(device, dtype)
        encoder = getattr(model, "roberta", model)
        model.check_inputs, encoder.unpad, encoder.cpu_group_tokens = False, unpad, cpu_group_tokens
        return model

    if device.type == "cpu":
        unpadded = weighed("rf-unpadded", lambda: ours("reference"))
        runs["rf-unpadded"] = lambda ids, mask: hidden(unpadded(ids, attention_mask=mask))
        if wanted("rf-padded"):
            padded = ours("reference", unpad=False)
            runs["rf-padded"] = lambda ids, mask: hidden(padded(ids, attention_mask=mask))
        if wanted("rf-unpadded-whole"):
            whole = ours("reference", cpu_group_tokens=None)
            runs["rf-unpadded-whole"] = lambda ids, mask: hidden(whole(ids, attention_mask=mask))
        if skip_compile:
            runs["rf-compile"] = "skipped (--skip-compile or --quick)"
        else:
            compiled_rf = torch.compile(unpadded, dynamic=True)
            runs["rf-compile"] = lambda ids, mask: hidden(compiled_rf(ids, attention_mask=mask))
        fp32_only = "fp32 only (onnxruntime's CPU provider has no bf16 matmul)"
        if wanted("onnxruntime"):
            runs["onnxruntime"] = onnx_runner("onnxruntime", ours("reference"), example) if dtype == torch.float32 \
                else fp32_only
        if wanted("rf-prepacked") and dtype == torch.float32:
            prepacked = weighed("rf-prepacked", lambda: rf.prepack(ours("reference")))
            runs["rf-prepacked"] = lambda ids, mask: hidden(prepacked(ids, attention_mask=mask))
        elif wanted("rf-prepacked"):
            runs["rf-prepacked"] = "fp32 only (oneDNN's packed fp32 weights)"
        if wanted("rf-fp16-weights") and dtype == torch.float32:
            fp16w = weighed("rf-fp16-weights", lambda: rf.quantize(ours("reference"), dtype=torch.float16))
            runs["rf-fp16-weights"] = lambda ids, mask: hidden(fp16w(ids, attention_mask=mask))
        elif wanted("rf-fp16-weights"):
            runs["rf-fp16-weights"] = "fp32 only (fp16 weights in an fp32 model)"
        int8_fp32_only = "quantizes the fp32 model (int8 weights, fp32 elsewhere)"
        if dtype != torch.float32:
            runs.update({k: int8_fp32_only for k in INT8_CONTENDERS})
        else:
            int8 = weighed("rf-int8", lambda: rf.quantize(ours("reference")))
            runs["rf-int8"] = lambda ids, mask: hidden(int8(ids, attention_mask=mask))
            if wanted("rf-int8-7bit"):
                int8_7bit = weighed("rf-int8-7bit", lambda: rf.quantize(ours("reference"), activation_bits=7))
                runs["rf-int8-7bit"] = lambda ids, mask: hidden(int8_7bit(ids, attention_mask=mask))
            if wanted("rf-int8-whole"):
                int8_whole = weighed("rf-int8-whole", lambda: rf.quantize(ours("reference", cpu_group_tokens=None)))
                runs["rf-int8-whole"] = lambda ids, mask: hidden(int8_whole(ids, attention_mask=mask))
            if wanted("rf-int8-fbgemm"):
                fbgemm = weighed("rf-int8-fbgemm", lambda: rf.quantize(ours("reference"), engine="fbgemm"))
                runs["rf-int8-fbgemm"] = lambda ids, mask: hidden(fbgemm(ids, attention_mask=mask))
            if wanted("rf-int8-auto"):
                auto = weighed("rf-int8-auto", lambda: rf.quantize(ours("reference"), engine="auto"))
                runs["rf-int8-auto"] = lambda ids, mask: hidden(auto(ids, attention_mask=mask))
            if wanted("onnxruntime-int8"):
                runs["onnxruntime-int8"] = onnx_runner("onnxruntime-int8", ours("reference"), example, int8=True)
            if wanted("onnxruntime-int8-7bit"):
                runs["onnxruntime-int8-7bit"] = onnx_runner("onnxruntime-int8-7bit", ours("reference"), example,
                                                            int8=True, reduce_range=True)
            if wanted("rf-int8-onnxruntime"):
                runs["rf-int8-onnxruntime"] = onnx_runner("rf-int8-onnxruntime", rf.quantize(ours("reference")),
                                                          example, translations=onnx_translation_table)
            if wanted("hf-int8"):
                hf_int8 = weighed("hf-int8", lambda: torch_dynamic_int8(hf_sdpa(cfg, device, dtype, head)))
                runs["hf-int8"] = lambda ids, mask: hidden(hf_int8(input_ids=ids, attention_mask=mask))
    else:
        for backend in ("fused", "reference"):
            model = ours(backend)
            runs[f"rf-{backend}"] = (lambda m: lambda ids, mask: hidden(m(ids, attention_mask=mask)))(model)
        patched = rf.patch(copy.deepcopy(sdpa))
        runs["hf-patched"] = lambda ids, mask: hidden(patched(input_ids=ids, attention_mask=mask))
    if skip_compile:
        runs["hf-compile"] = "skipped (--skip-compile or --quick)"
    else:
        compiled = torch.compile(sdpa, dynamic=True)
        runs["hf-compile"] = lambda ids, mask: hidden(compiled(input_ids=ids, attention_mask=mask))
    return runs


def _rss_mb(field="VmRSS"):
    """This process's resident set (or its high-water mark, VmHWM) in MB; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def _reset_peak_rss():
    """Start a new VmHWM measurement (Linux: writing 5 to clear_refs resets the peak RSS)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _kernel_work():
    """(system CPU seconds, minor page faults) of this process so far: on the CPU, fresh memory from
    the OS shows as page faults and the kernel's time serving them (docs/inference.md, "The
    allocator"); None where the resource module is missing (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_stime, usage.ru_minflt


def one_pass(fn, data, device):
    """Run every batch once; (seconds, outputs)."""
    start = time.perf_counter()
    outs = [fn(ids, mask) for ids, mask in data]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, outs


def max_diff(outs, reference, data):
    """max |out - reference| over real (attended) positions of every batch."""
    return max(float((o.float() - r.float())[mask.bool()].abs().max()) for o, r, (_, mask) in zip(outs, reference, data))


def graph_count():
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def measure(runs, data, device, repeats, reference):
    """Warm-up pass (outputs checked against `reference`), then `repeats` interleaved timed passes.
    Returns the rows and {contender: median ms per batch}, unrounded: the rows' figures are rounded for
    reading, so tokens/s and every ratio are derived from this."""
    rows, times, peaks, kernel_work = {}, {}, {}, {}
    graphs = {}  # compile contender -> the graphs its own passes compiled (dynamo's counter is process-wide)
    for name, fn in runs.items():
        if isinstance(fn, str):
            rows[name] = {"contender": name, "status": fn}
            continue
        before = graph_count() if name.endswith("compile") else None
        _, outs = one_pass(fn, data, device)
        rows[name] = {"contender": name, "status": "ok",
                      "max_abs_diff_vs_hf_fp32": bc.sig(max_diff(outs, reference, data))}
        if name.endswith("compile"):
            graphs[name] = rows[name]["graphs_after_warmup"] = graph_count() - before
        times[name], peaks[name], kernel_work[name] = [], 0, []
        del outs
    for _ in range(repeats):
        for name in times:
            _reset_peak_rss()
            graphs_before = graph_count() if name in graphs else None
            before = _kernel_work()
            seconds, _ = one_pass(runs[name], data, device)
            if name in graphs:
                graphs[name] += graph_count() - graphs_before
            if before is not None:
                kernel_work[name].append([after - start for after, start in zip(_kernel_work(), before)])
            times[name].append(seconds)
            peaks[name] = max(peaks[name], _rss_mb("VmHWM") or 0)
    ms = {}
    for name, ts in times.items():
        ms[name] = 1e3 * statistics.median(ts) / len(data)
        rows[name].update(ms_per_batch=bc.sig(ms[name]), seconds_all=[bc.sig(t) for t in ts])
        if device.type == "cpu":
            rows[name]["peak_rss_mb"] = peaks[name]
            rows[name]["weights_mb"] = WEIGHTS_MB.get(name)
            if kernel_work[name]:  # medians per batch: the OS's share of the work
                sys_s, faults = (statistics.median(column) for column in zip(*kernel_work[name]))
                rows[name].update(sys_ms_per_batch=bc.sig(1e3 * sys_s / len(data)),
                                  page_faults_per_batch=round(faults / len(data)))
        if name in graphs:
            rows[name]["graphs_after_timing"] = graphs[name]
    return rows, ms


def add_rates(rows, ms, real_tokens, n_batches):
    """Each timed row's real tokens/s and its speed over hf-sdpa's, from the unrounded `ms` of measure()."""
    peer = ms.get("hf-sdpa")
    for name, row in rows.items():
        if name in ms:
            row["tokens_per_s"] = bc.sig(real_tokens / (ms[name] * n_batches / 1e3))
            row["vs_hf_sdpa"] = bc.sig(peer / ms[name]) if peer else None


# (name, lengths, dtype, contender, metric, goal, at least?): the targets, device by device
TARGETS = {
    "cpu": [("rf-unpadded vs hf-sdpa, uniform 8..512, fp32", "uniform", "fp32", "rf-unpadded", "vs_hf_sdpa", 1.6, True),
            ("rf-unpadded vs onnxruntime, uniform 8..512, fp32", "uniform", "fp32", "rf-unpadded", "vs_onnxruntime",
             1.0, True),
            ("rf-unpadded max |diff| to transformers fp32, uniform, fp32", "uniform", "fp32", "rf-unpadded",
             "max_abs_diff_vs_hf_fp32", 1e-5, False),
            ("rf-unpadded vs hf-sdpa, fixed lengths (no padding), fp32", "fixed", "fp32", "rf-unpadded", "vs_hf_sdpa",
             1.0, True),
            ("rf-int8 vs hf-sdpa fp32, fixed 128", "fixed", "fp32", "rf-int8", "vs_hf_sdpa", 1.8, True),
            ("rf-int8 vs onnxruntime-int8, fixed 128", "fixed", "fp32", "rf-int8", "vs_onnxruntime-int8", 1.0, True),
            ("rf-int8 vs onnxruntime-int8-7bit, fixed 128", "fixed", "fp32", "rf-int8", "vs_onnxruntime-int8-7bit", 1.0,
             True),
            ("rf-int8 vs hf-sdpa fp32, uniform 8..512", "uniform", "fp32", "rf-int8", "vs_hf_sdpa", 3.0, True)],
    "cuda": [("rf-fused vs hf-sdpa, uniform 8..512, bf16", "uniform", "bf16", "rf-fused", "vs_hf_sdpa", 2.0, True)],
}


INT8_WEIGHTS_GOAL = 0.3  # the int8 Linear weights' memory as a fraction of fp32's: "about a quarter"


def evaluate_targets(results, device, weights=(), off_target=None, ms=None, off_model=None):
    """Each target of TARGETS with what this run achieved: status met, missed or not measured;
    `weights`: linear_weights() of the rf-int8 engines, the first (the default, rf-int8's) held to the
    memory target, the others reported beside it (fbgemm pads; "auto" holds two packings); `off_target`: why
    this run's shapes are not the targets' (then no speed target is measured); `ms`: {(lengths, dtype,
    contender): unrounded ms per batch} for the ratios (else the rows' rounded ms_per_batch); `off_model`:
    why this run's model is not the targets' roberta-base (--quick's tiny one: then no target is measured)."""
    rows = {(r["lengths"], r["dtype"], r["contender"]): r for r in results}
    ms = {**{key: r.get("ms_per_batch") for key, r in rows.items()}, **(ms or {})}
    out = [{"target": f"rf-int8 ({w['engine']}) Linear weights vs fp32 (about a quarter)",
            "goal": f"<= {INT8_WEIGHTS_GOAL:g}", "achieved": None if off_model else w["int8_vs_fp32"],
            "status": f"not measured ({off_model})" if off_model else
            "met" if w["int8_vs_fp32"] <= INT8_WEIGHTS_GOAL else "missed"} for w in weights[:1] if w]
    for name, lengths, dtype, contender, metric, goal, at_least in TARGETS[device.type]:
        row = rows.get((lengths, dtype, contender), {})
        achieved = row.get(metric)
        if metric.startswith("vs_onnxruntime") and row.get("status") == "ok":
            peer = (lengths, dtype, metric[3:])
            ok = rows.get(peer, {}).get("status") == "ok"
            achieved = bc.sig(ms[peer] / ms[lengths, dtype, contender]) if ok else None
        why = (off_target if metric != "max_abs_diff_vs_hf_fp32" else None) or off_model
        if why:
            achieved = None  # a speed measured on other shapes, or a figure of another model, than the target's
        if achieved is None:
            status = f"not measured ({why})" if why else "not measured"
        else:
            status = "met" if (achieved >= goal if at_least else achieved <= goal) else "missed"
        out.append({"target": name, "goal": (">= " if at_least else "<= ") + f"{goal:g}", "achieved": achieved,
                    "status": status})
    return out


def parser():
    p = bc.parser(__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile contenders")
    p.add_argument("--lengths", default=None,
                   help="comma-separated: uniform, corpus, fixed (default: all three on the CPU)")
    p.add_argument("--dtypes", default=None, help="comma-separated: fp32, bf16 (default: fp32,bf16 on the CPU)")
    p.add_argument("--batches", type=int, default=None, help="batches per pass")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per batch (default 32)")
    p.add_argument("--fixed-length", type=int, default=None, help="tokens per sequence of --lengths fixed "
                   "(default 128)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes per contender (median)")
    p.add_argument("--only", default=None, help="comma-separated contenders to run (hf-sdpa, the peer, always runs)")
    p.add_argument("--chart", default=None, help="bar chart of real tokens/s (PNG; default: beside the record)")
    p.add_argument("--note", default=None, help="a sentence kept in the record (e.g. what else ran on the machine)")
    p.add_argument("--head", choices=sorted(HEAD_CLASSES), default="encoder",
                   help="encoder (RobertaModel, the default) or mlm (RobertaForMaskedLM, logits at every position)")
    return p


def main():
    p = parser()
    args = p.parse_args()
    unknown = sorted(set(args.only.split(",")) - set(CONTENDERS)) if args.only else []
    if unknown:
        p.error(f"--only: no contender named {', '.join(unknown)}; the contenders are {', '.join(CONTENDERS)}")
    device = torch.device(args.device) if args.device else bc.default_device()
    quick = args.quick
    if quick:
        cfg = rf.RobertaConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=128, max_position_embeddings=66)
        shape, lengths, dtypes, repeats = dict(count=2, batch_size=4, low=4, high=64), ["uniform"], ["fp32"], 1
        fixed = 32
    else:
        cfg = rf.RobertaConfig.preset("base")
        shape, repeats = dict(count=2, batch_size=32, low=8, high=512), 3
        lengths = ["uniform", "corpus", "fixed"] if device.type == "cpu" else ["uniform"]
        fixed = 128
        dtypes = ["fp32", "bf16"] if device.type == "cpu" else ["bf16"]
    lengths = args.lengths.split(",") if args.lengths else lengths
    dtypes = args.dtypes.split(",") if args.dtypes else dtypes
    shape["count"] = args.batches or shape["count"]
    shape["batch_size"] = args.batch_size or shape["batch_size"]
    fixed = args.fixed_length or fixed
    # the speed targets are for batches of 32 and fixed 128-token sequences
    off_target = None if quick or (shape["batch_size"], fixed) == (32, 128) else \
        f"batches of {shape['batch_size']}, fixed {fixed} tokens: the targets are for 32 and 128"
    if args.head != "encoder":
        off_target = f"--head {args.head}: the targets are for the encoder (RobertaModel)"
    off_model = "--quick: tiny model" if quick else None  # the targets are roberta-base's
    repeats = args.repeats or repeats
    skip_compile = args.skip_compile or quick
    facts = bc.device_facts(device)
    print(f"device: {facts['name']} ({facts.get('cores', '')} cores, {torch.get_num_threads()} threads)  "
          f"load before: {os.getloadavg()}")

    results, configs, exact_ms = [], {}, {}
    if args.json or quick:
        path = args.json
    elif device.type == "cuda":
        path = bc.record_path(args, "inference", device)
    else:  # CPU records are labelled as such
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                            f"inference-cpu-{facts['cores']}cores-{bc.environment(device)['date'][:10]}.json")

    def write(results, targets):
        """The record so far: written after each length mix, so a run cut off keeps what it measured."""
        if path:
            bc.write_json(path, bc.environment(device), results, config=dict(
                lengths=configs, model="tiny" if quick else "roberta-base shape, random weights",
                head=HEAD_CLASSES[args.head],
                threads=torch.get_num_threads(), repeats=repeats, load_after=os.getloadavg(),
                rf_int8_engine=default_engine(), rf_int8_activation_bits=default_activation_bits(default_engine()),
                int8_linear_weights=weights, fp16_linear_weights=fp16_weights,
                note=args.note), targets=targets)
            print(f"\nwrote {path}")

    only = args.only.split(",") if args.only else None
    # --quick (CI) leaves out a second ONNX export and quantize_dynamic of the same encoder: the 7-bit setting
    wanted = lambda name: name in only if only else not (quick and name == "onnxruntime-int8-7bit")  # noqa: E731
    weights = []  # the int8 Linear layers' memory, each engine rf-int8 runs with
    if device.type == "cpu" and "fp32" in dtypes and wanted("rf-int8"):
        engines = [default_engine()] + [e for e in ("fbgemm", "auto") if wanted(f"rf-int8-{e}")]
        weights = [linear_weights(cfg, engine) for engine in dict.fromkeys(engines)]
        print("int8 Linear weights:", weights)
    fp16_weights = None  # the same for rf-fp16-weights
    if device.type == "cpu" and "fp32" in dtypes and wanted("rf-fp16-weights"):
        fp16_weights = linear_weights(cfg, "fp16")
        print("fp16 Linear weights:", fp16_weights)

    for dist in lengths:
        if dist not in ("uniform", "corpus", "fixed"):
            raise SystemExit(f"--lengths {dist!r}: use uniform, corpus or fixed")
        draw = {"corpus": lambda: corpus_lengths(cfg.max_seq_len), "fixed": lambda: fixed_lengths(fixed),
                "uniform": lambda: None}[dist]()
        data = [(ids.to(device), mask.to(device))
                for ids, mask in batches(vocab=cfg.vocab_size, lengths_from=draw, **shape)]
        real_tokens = sum(int(mask.sum()) for _, mask in data)
        padded_tokens = sum(mask.numel() for _, mask in data)
        configs[dist] = dict(shape, real_tokens=real_tokens, padded_tokens=padded_tokens,
                             **({"length": fixed} if dist == "fixed" else {}))
        print(f"\n== lengths {dist}: {shape['count']} batches of {shape['batch_size']}, real tokens/pass "
              f"{real_tokens} (padded to {padded_tokens})")
        reference = None
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            runs = contenders(cfg, device, dtype, skip_compile, data[0], wanted, args.head)
            runs = {k: v for k, v in runs.items() if k == "hf-sdpa" or wanted(k)}
            with torch.inference_mode():
                if reference is None:  # transformers SDPA in fp32 on the same weights
                    ref_model = hf_sdpa(cfg, device, torch.float32, args.head)
                    reference = [hidden(ref_model(input_ids=ids, attention_mask=mask)) for ids, mask in data]
                    del ref_model
                rows, ms = measure(runs, data, device, repeats, reference)
            del runs
            add_rates(rows, ms, real_tokens, len(data))
            exact_ms.update({(dist, dtype_name, name): value for name, value in ms.items()})
            for row in rows.values():
                row.update(lengths=dist, dtype=dtype_name, load_1min_after=bc.sig(os.getloadavg()[0]))
            print(f"-- {dist} {dtype_name}  (load after: {os.getloadavg()})")
            bc.print_rows(list(rows.values()), ["contender", "status", "ms_per_batch", "tokens_per_s", "vs_hf_sdpa",
                                                "max_abs_diff_vs_hf_fp32", "peak_rss_mb", "weights_mb",
                                                "page_faults_per_batch"])
            results += list(rows.values())
        write(results, evaluate_targets(results, device, weights, off_target, exact_ms, off_model))
    targets = evaluate_targets(results, device, weights, off_target, exact_ms, off_model)
    print("\ntargets:")
    bc.print_rows(targets, ["target", "goal", "achieved", "status"])
    chart = args.chart or (path and not quick and os.path.splitext(path)[0] + ".png")
    if chart:
        print(throughput_chart({"environment": bc.environment(device), "results": results,
                                "config": {"head": HEAD_CLASSES[args.head]}}, chart))


if __name__ == "__main__":
    main()
