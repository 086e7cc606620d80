"""Smoke tests of benchmarks/: throughput.py --quick end to end, every bench_*.py --quick,
and throughput.py's bookkeeping (ratios, targets, comparison, the results record) on
reports built here, so a wrong figure in the record fails a test on any machine.

Performance itself is never asserted: the benchmarks measure it, on a GPU.
"""
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
KERNEL_BENCHES = ("bench_attention", "bench_bias_gelu", "bench_layer_norm", "bench_cross_entropy",
                  "bench_fused_adam", "bench_mask_tokens", "bench_preprocess", "bench_inference",
                  "bench_activation_checkpointing", "bench_cpu_linear", "bench_loader")


def _load_benchmark(name):
    """benchmarks/<name>.py as a module (benchmarks/ on the path for its `import _common`)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


T = _load_benchmark("throughput")


def _run(args, timeout=300):
    """Run a benchmark script from the repository root; one torch thread (two run at once)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


# ----------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every benchmark's --quick run, two at a time (CI has 2 cores; most of a run is imports).

    Returns (output directory, {name: CompletedProcess}); absent kernel benchmarks are left out.
    """
    out = tmp_path_factory.mktemp("benchmarks")
    jobs = {"throughput": ["benchmarks/throughput.py", "--quick", "--skip-compile", "--device", "cpu",
                           "--json", str(out / "quick.json"), "--chart", str(out / "quick.png")]}
    for name in KERNEL_BENCHES:
        if (BENCH / f"{name}.py").exists():
            jobs[name] = [f"benchmarks/{name}.py", "--quick", "--json", str(out / f"{name}.json")]  # as gpu_session.sh
    if "bench_inference" in jobs:
        jobs["bench_inference"] += ["--device", "cpu", "--json", str(out / "inference.json")]
        jobs["bench_inference_mlm"] = ["benchmarks/bench_inference.py", "--quick", "--device", "cpu", "--head", "mlm",
                                       "--only", "rf-unpadded,rf-int8,rf-fp16-weights,onnxruntime-int8",
                                       "--json", str(out / "inference-mlm.json")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, args) for name, args in jobs.items()}
        return out, {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def quick_report(runs):
    """The `throughput.py --quick --skip-compile` run: (directory, stdout, report)."""
    out, procs = runs
    proc = procs["throughput"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stdout, json.loads((out / "quick.json").read_text())


def test_quick_run_reports_every_contender(quick_report):
    out, stdout, report = quick_report
    assert report["schema"] == T.SCHEMA
    for key in ("environment", "config", "batch_choice", "results", "targets", "profiles"):
        assert key in report, key
    env = report["environment"]
    assert env["device"]["type"] == "cpu" and env["versions"]["torch"] == torch.__version__
    assert env["commit"] and env["date"] and "transformers" in env["versions"]
    rows = report["results"]
    assert [r["contender"] for r in rows] == list(T.CONTENDERS)
    for r in rows:
        assert r["status"] in ("ok", "skipped"), r  # "failed" means a contender is broken
        assert (r["model"], r["seq_len"], r["dtype"], r["batch"]) == ("tiny", 64, "fp32", 4)
        if r["status"] == "skipped":
            assert r["reason"] and r["reason"] in stdout  # skipped with the reason, never dropped
    compiled = next(r for r in rows if r["contender"] == "hf-compile")
    assert compiled["status"] == "skipped" and "--skip-compile" in compiled["reason"]
    assert any(r["status"] == "ok" for r in rows), "no contender ran on the CPU"
    if importlib.util.find_spec("transformers") is not None:
        assert next(r for r in rows if r["contender"] == "hf-eager")["status"] == "ok"


def test_quick_run_figures_are_consistent(quick_report):
    _, _, report = quick_report
    ok = [r for r in report["results"] if r["status"] == "ok"]
    hf = next((r for r in ok if r["contender"] == "hf-eager"), None)
    for r in ok:
        assert len(r["ms_per_step_blocks"]) == report["config"]["repeats"] == 3
        assert r["ms_per_step"] == pytest.approx(sorted(r["ms_per_step_blocks"])[1])  # the median
        tokens = r["batch"] * r["seq_len"]
        assert r["tokens_per_s"] == pytest.approx(tokens / (r["ms_per_step"] / 1e3))
        assert r["sequences_per_s"] == pytest.approx(r["batch"] / (r["ms_per_step"] / 1e3))
        # ~15% of the 61 ordinary tokens per sequence are predicted; specials never are
        assert 0 < r["predicted_per_step"] <= r["batch"] * (r["seq_len"] - 3)
        assert r["mfu"] is None and r["peak_memory_gib"] is None  # no datasheet peak for a CPU
        if hf is not None:
            assert r["vs_hf_eager"] == pytest.approx(r["tokens_per_s"] / hf["tokens_per_s"])
        assert r["vs_hf_compile"] is None  # the peer was skipped
        assert (r.get("host_collate_ms", 0) > 0) == r["contender"].startswith("hf-")
    assert all(t["status"] == "not evaluated" for t in report["targets"])


def test_quick_run_writes_a_chart(quick_report):
    out, stdout, _ = quick_report
    charts = [p for p in (out / "quick.png", out / "quick.svg") if p.exists() and p.stat().st_size > 0]
    assert charts, stdout
    assert not list(out.glob(".*tmp*")), "a temporary file was left behind"


def test_compare_against_a_previous_run(quick_report, tmp_path):
    out, _, report = quick_report
    old = json.loads(json.dumps(report))
    hf = next(r for r in old["results"] if r["contender"] == "hf-eager" and r["status"] == "ok")
    hf["tokens_per_s"] *= 2  # the new run is then 50% slower than the old one
    text = T.compare(old, report)
    line = next(li for li in text.splitlines() if "hf-eager" in li)
    assert line.split()[-1] == "-50.0%"
    assert "devices differ" not in text
    old["environment"]["device"]["name"] = "NVIDIA H100 80GB HBM3"
    assert "devices differ" in T.compare(old, report)


@pytest.mark.parametrize("name", KERNEL_BENCHES)
def test_kernel_benchmark_quick(name, runs):
    out, procs = runs
    if name not in procs:
        pytest.skip(f"benchmarks/{name}.py is not written yet")
    proc = procs[name]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / ("inference.json" if name == "bench_inference" else f"{name}.json")).stat().st_size > 0  # --json


def test_cpu_linear_benchmark_times_every_kernel_on_the_same_weights(runs):
    """bench_cpu_linear --quick: one layer, and two encoder blocks' layers chained, through torch,
    rf.prepack, rf's fp16 weights, rf.quantize's two int8 engines and onnxruntime (fp32 and int8, when
    installed), each within its precision's error of F.linear (onnxruntime's default u8s8 int8
    saturates on CPUs without VNNI: its bound is loose)."""
    out, procs = runs
    assert procs["bench_cpu_linear"].returncode == 0, procs["bench_cpu_linear"].stderr
    rows = json.loads((out / "bench_cpu_linear.json").read_text())["results"]
    assert {r["tokens"] for r in rows} == {1, 16}
    assert {r["layers"] for r in rows} == {1, 8}  # one layer, and a chained stack of two encoder blocks
    names = {"torch", "rf-prepacked", "rf-fp16-weights", "rf-int8", "rf-int8-fbgemm"}
    if importlib.util.find_spec("onnxruntime") is not None:
        names |= {"onnxruntime", "onnxruntime-int8", "onnxruntime-int8-7bit"}
    for row in rows:
        if row["contender"] not in names:
            assert "not installed" in row["status"], row
            continue
        assert row["status"] == "ok" and row["ms"] > 0, row
        bound = (0.5 if row["contender"].startswith("onnxruntime-int8") else 0.02 if "int8" in row["contender"]
                 else 2e-3 if "fp16" in row["contender"] else 1e-5)  # fp16 weights: 2^-11 relative rounding each
        assert row["max_rel_diff"] <= bound, row
    assert {r["contender"] for r in rows if r["status"] == "ok"} == names


def test_inference_benchmark_runs_every_cpu_contender_on_the_same_weights(runs):
    """bench_inference --quick --device cpu: the unpadded, padded and prepacked encoders, transformers and
    onnxruntime (when installed) run and agree with transformers fp32 at real positions; fp16 weights
    and int8 within their rounding of it."""
    out, procs = runs
    assert procs["bench_inference"].returncode == 0, procs["bench_inference"].stderr
    rows = {r["contender"]: r for r in json.loads((out / "inference.json").read_text())["results"]}
    expected = ["hf-sdpa", "hf-eager", "rf-unpadded", "rf-unpadded-whole", "rf-padded", "rf-prepacked"]
    assert rows["rf-fp16-weights"]["status"] == "ok", rows["rf-fp16-weights"]  # fp16 weights: 2^-11 rounding each
    assert 0 < rows["rf-fp16-weights"]["max_abs_diff_vs_hf_fp32"] <= 2e-3, rows["rf-fp16-weights"]
    if importlib.util.find_spec("onnxruntime") is not None:
        expected.append("onnxruntime")
    else:
        assert "not installed" in rows["onnxruntime"]["status"]
    for name in expected:
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["max_abs_diff_vs_hf_fp32"] <= 1e-5 and rows[name]["tokens_per_s"] > 0, rows[name]
    assert rows["rf-compile"]["status"].startswith("skipped")
    int8 = ["rf-int8", "rf-int8-whole", "rf-int8-fbgemm", "rf-int8-auto", "hf-int8"]
    int8 += ["rf-int8-onnxruntime"] if "onnxruntime" in expected else []
    for name in int8:  # int8: within quantization error of fp32
        assert rows[name]["status"] == "ok" and rows[name]["max_abs_diff_vs_hf_fp32"] <= 0.05, rows[name]
    assert set(rows) <= set(_load_benchmark("bench_inference").CONTENDERS)  # what --only accepts
    record = json.loads((out / "inference.json").read_text())
    weights = {w["engine"]: w for w in record["config"]["int8_linear_weights"]}
    assert set(weights) == {record["config"]["rf_int8_engine"], "fbgemm", "auto"}
    assert all(w["fp32_mb"] > 0 and w["int8_mb"] is not None for w in weights.values()), weights
    fp16 = record["config"]["fp16_linear_weights"]
    assert fp16["fp32_mb"] > 0 and fp16["fp16_mb"] is not None, fp16


def test_inference_quick_run_measures_no_target(runs):
    """bench_inference --quick runs a tiny model: the targets (roberta-base's speed, accuracy and int8 weight
    memory) read not measured, with why, instead of met or missed on figures of another model."""
    out, procs = runs
    assert procs["bench_inference"].returncode == 0, procs["bench_inference"].stderr
    targets = json.loads((out / "inference.json").read_text())["targets"]
    assert targets and all(t["status"] == "not measured (--quick: tiny model)" and t["achieved"] is None
                           for t in targets), targets


def test_inference_benchmark_times_the_mlm_head_with_every_framework_on_the_same_weights(runs):
    """bench_inference --head mlm: each contender runs its RobertaForMaskedLM, and the logits (every
    position) agree with transformers' fp32 ones: exactly in fp32, within rounding with fp16 weights
    and int8 (rf.quantize quantizes the decoder too); the encoder's targets are not measured."""
    out, procs = runs
    assert procs["bench_inference_mlm"].returncode == 0, procs["bench_inference_mlm"].stderr
    record = json.loads((out / "inference-mlm.json").read_text())
    assert record["config"]["head"] == "RobertaForMaskedLM"
    rows = {r["contender"]: r for r in record["results"]}
    bounds = {"hf-sdpa": 1e-5, "rf-unpadded": 1e-5, "rf-fp16-weights": 2e-3, "rf-int8": 0.05}
    if importlib.util.find_spec("onnxruntime") is not None:
        bounds["onnxruntime-int8"] = 0.05
    for name, bound in bounds.items():
        assert rows[name]["status"] == "ok" and rows[name]["max_abs_diff_vs_hf_fp32"] <= bound, rows[name]
    assert rows["rf-int8"]["max_abs_diff_vs_hf_fp32"] > 0
    speed = [t for t in record["targets"] if "max |diff|" not in t["target"] and "Linear weights" not in t["target"]]
    assert speed and all(t["status"].startswith("not measured (--head mlm") for t in speed), speed


def test_onnxruntime_int8_of_the_mlm_head_runs_its_decoder_as_an_int8_matmul(tmp_path):
    """onnxruntime-int8 with --head mlm: the tied decoder is an integer matmul on an int8 table and the
    embedding lookup stays fp32, not a DequantizeLinear of the whole quantized table before an fp32 MatMul
    (quantize_dynamic's defaults), which dequantizes the (H, V) table every request."""
    import warnings

    pytest.importorskip("onnxruntime", reason="needs onnxruntime (the [export] extra)")
    onnx = pytest.importorskip("onnx", reason="needs onnx (the [export] extra)")
    bench = _load_benchmark("bench_inference")
    cfg = bench.rf.RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=34)
    torch.manual_seed(0)
    model = bench.rf.RobertaForMaskedLM(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (2, 8))
    dims = {0: torch.export.Dim("batch", min=2, max=4096), 1: torch.export.Dim("seqlen", min=2, max=cfg.max_seq_len)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (ids,), kwargs={"attention_mask": torch.ones_like(ids)}, dynamo=True,
                                    verbose=False, dynamic_shapes={"input_ids": dims, "attention_mask": dims})
    program.save(str(tmp_path / "mlm.onnx"))
    bench.onnx_int8(str(tmp_path / "mlm.onnx"), str(tmp_path / "mlm-int8.onnx"), tied_decoder=True)
    graph = onnx.load(str(tmp_path / "mlm-int8.onnx")).graph
    assert "DequantizeLinear" not in {n.op_type for n in graph.node}  # no int8 table made fp32 again per request
    fp32 = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    lookup = next(n for n in graph.node if n.op_type == "Gather" and "input_ids" in n.input)
    assert lookup.input[0] in fp32, list(lookup.input)
    integer = [n for n in graph.node if n.op_type == "MatMulInteger"]
    assert len(integer) == 4 * cfg.num_hidden_layers + 2  # qkv, out, FFN in and out per layer; head dense, decoder


def test_preprocess_benchmark_writes_its_json_after_each_section(tmp_path, monkeypatch):
    """bench_preprocess writes the formats' rows before the next section starts: a run cut off
    there (a time cap) still leaves them in --json."""
    bench = _load_benchmark("bench_preprocess")
    monkeypatch.setattr(bench, "bc", importlib.import_module("_common"), raising=False)  # imported only under __main__
    row = {"impl": "roberta_fast jsonl", "documents": 1, "x_vs_plain": 1.0, "x_vs_datasets": 2.0}
    monkeypatch.setattr(bench, "time_formats", lambda *args: [row])

    def cut_off(*args):
        raise KeyboardInterrupt  # as timeout --signal=INT stops it

    monkeypatch.setattr(bench, "others", cut_off)
    out = tmp_path / "pre.json"
    monkeypatch.setattr(sys, "argv", ["bench_preprocess.py", "--quick", "--json", str(out)])
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    record = json.loads(out.read_text())
    assert record["formats"] == [row] and record["results"] == [] and record["targets"]


def test_records_name_the_commit_where_the_tree_has_no_git(tmp_path):
    """The GPU machine's copy of the tree has no .git: ROBERTA_FAST_COMMIT names the commit there."""
    (tmp_path / "_common.py").write_text((BENCH / "_common.py").read_text())
    probe = [sys.executable, "-c", "import _common; print(_common._git_commit())"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    for given, expected in (("0123abcd", "0123abcd"), (None, "unknown")):
        run_env = dict(env, ROBERTA_FAST_COMMIT=given) if given else env
        out = subprocess.run(probe, cwd=tmp_path, env=run_env, capture_output=True, text=True, check=True)
        assert out.stdout.strip().splitlines()[-1] == expected, out


# ---------------------------------------------------------------- bookkeeping
def _row(contender, tps, model="base", seq=512, dtype="bf16", mfu=None):
    return {"contender": contender, "model": model, "seq_len": seq, "dtype": dtype, "batch": 8,
            "status": "ok", "tokens_per_s": tps, "sequences_per_s": tps / seq, "ms_per_step": 8 * seq / tps * 1e3,
            "mfu": mfu, "peak_memory_gib": 1.0}


def test_ratios_and_targets():
    rows = [_row("rf-fused", 300.0, mfu=0.5), _row("hf-eager", 200.0), _row("hf-compile", 240.0),
            {"contender": "rf-reference", "model": "base", "seq_len": 512, "dtype": "bf16", "batch": 8,
             "status": "skipped", "reason": "why"}]
    T.add_ratios(rows)
    assert rows[0]["vs_hf_eager"] == pytest.approx(300 / 200)
    assert rows[0]["vs_hf_compile"] == pytest.approx(300 / 240)
    assert rows[3]["vs_hf_eager"] is None
    targets = {t["metric"]: t for t in T.evaluate_targets(rows, torch.device("cuda"))}
    eager = targets["vs_hf_eager"]
    assert eager["status"] == "missed"
    assert eager["shortfall"] == pytest.approx(T.TARGETS["vs_hf_eager"] - 1.5)
    assert eager["shortfall_fraction"] == pytest.approx(1 - 1.5 / T.TARGETS["vs_hf_eager"])
    assert targets["vs_hf_compile"]["status"] == ("met" if 1.25 >= T.TARGETS["vs_hf_compile"] else "missed")
    assert targets["mfu"]["status"] == ("met" if 0.5 >= T.TARGETS["mfu"] else "missed")
    on_cpu = T.evaluate_targets(rows, torch.device("cpu"))
    assert on_cpu and all(t["status"] == "not evaluated" for t in on_cpu)


def test_inference_benchmark_refuses_a_contender_it_does_not_have(monkeypatch, capsys):
    """--only with a misspelt name stops before anything is built, naming it, instead of leaving
    that contender out of the record."""
    bench = _load_benchmark("bench_inference")
    monkeypatch.setattr(sys, "argv", ["bench_inference.py", "--device", "cpu", "--only", "rf-int8,rf-int9"])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2
    assert "no contender named rf-int9;" in capsys.readouterr().err


def test_inference_figures_come_from_unrounded_medians(monkeypatch):
    """ms_per_batch is rounded for reading, but tokens/s and every ratio come from the unrounded median
    (statistics.median: the mean of the middle two of an even count, not the upper one)."""
    bench = _load_benchmark("bench_inference")
    monkeypatch.setattr(bench, "one_pass", lambda timings, data, device: (next(timings), None))
    monkeypatch.setattr(bench, "max_diff", lambda outs, reference, data: 0.0)
    runs = {"hf-sdpa": iter([0.0, 1.0e-3, 1.46898e-3]), "rf-unpadded": iter([0.0, 1.23551e-3, 1.23551e-3])}
    rows, ms = bench.measure(runs, [None], torch.device("cpu"), 2, None)  # warm-up, then 2 timed passes
    assert ms["hf-sdpa"] == pytest.approx(1.23449) and rows["hf-sdpa"]["ms_per_batch"] == 1.23
    bench.add_rates(rows, ms, real_tokens=1000, n_batches=1)
    assert rows["rf-unpadded"]["vs_hf_sdpa"] == 0.999  # 1.23 / 1.24 from the rounded figures: 0.992
    assert rows["hf-sdpa"]["tokens_per_s"] == 810000  # 1000 tokens / 1.23 ms: 813000
    results = [{"contender": c, "lengths": "fixed", "dtype": "fp32", "status": "ok", "ms_per_batch": bench.bc.sig(v)}
               for c, v in (("rf-int8", 1.2351), ("onnxruntime-int8", 1.2449))]
    exact = {("fixed", "fp32", "rf-int8"): 1.2351, ("fixed", "fp32", "onnxruntime-int8"): 1.2449}
    target = next(t for t in bench.evaluate_targets(results, torch.device("cpu"), ms=exact)
                  if t["target"] == "rf-int8 vs onnxruntime-int8, fixed 128")
    assert target["achieved"] == bench.bc.sig(1.2449 / 1.2351) == 1.01  # 1.24 / 1.24 from the rounded figures: 1.0


def test_inference_graph_counts_are_each_compile_contenders_own(monkeypatch):
    """graphs_after_warmup / graphs_after_timing count the graphs each torch.compile contender's own passes
    compiled, not dynamo's process-wide total (which gave rf-compile hf-compile's graphs)."""
    bench = _load_benchmark("bench_inference")
    total = [0]
    compiles = {"hf-sdpa": iter([0, 0, 0]), "rf-compile": iter([6, 0, 0]), "hf-compile": iter([7, 1, 0])}

    def one_pass(compiled, data, device):  # graphs compiled per pass: the warm-up, then 2 timed ones
        total[0] += next(compiled)
        return 1.0, None

    monkeypatch.setattr(bench, "one_pass", one_pass)
    monkeypatch.setattr(bench, "max_diff", lambda outs, reference, data: 0.0)
    monkeypatch.setattr(bench, "graph_count", lambda: total[0])
    rows, _ = bench.measure(compiles, [None], torch.device("cpu"), 2, None)
    assert [rows["rf-compile"][k] for k in ("graphs_after_warmup", "graphs_after_timing")] == [6, 6]
    assert [rows["hf-compile"][k] for k in ("graphs_after_warmup", "graphs_after_timing")] == [7, 8]
    assert "graphs_after_warmup" not in rows["hf-sdpa"]


@pytest.mark.skipif(sys.platform == "win32", reason="cpu_session.sh is a bash script")
def test_cpu_session_script_runs_the_inference_benchmark_with_flags_it_takes():
    """benchmarks/cpu_session.sh (the CPU record in one command), rehearsed: every command it would
    run parses with bench_inference.py's own parser, names only contenders it has and writes its own
    record under benchmarks/results/; an unknown stage is refused."""
    bench = _load_benchmark("bench_inference")
    env = {**os.environ, "CPU_SESSION_DRY": "1"}
    script = str(BENCH / "cpu_session.sh")
    dry = subprocess.run(["bash", script], env=env, capture_output=True, text=True, check=True)
    commands = [shlex.split(line) for line in dry.stdout.splitlines()]
    assert len(commands) == 6  # batches: fixed, uniform; latency: 8, 16, 32 tokens; mlm
    records = []
    for command in commands:
        assert command[:2] == ["python", "benchmarks/bench_inference.py"], command
        args = bench.parser().parse_args(command[2:])
        assert args.device == "cpu" and args.only and set(args.only.split(",")) <= set(bench.CONTENDERS), command
        assert args.json.startswith("benchmarks/results/inference-cpu-"), command
        records.append(args.json)
    assert len(set(records)) == len(records)
    wrong = subprocess.run(["bash", script, "batches", "latencies"], env=env, capture_output=True, text=True)
    assert wrong.returncode == 2 and "no stage latencies" in wrong.stderr
    assert not wrong.stdout  # refused before the first stage runs


def test_inference_speed_targets_are_not_measured_off_their_shapes():
    """bench_inference --batch-size 1 (single requests): the issue's speed targets are for batches
    of 32 x 128 tokens, so such a run reports them not measured, with why; accuracy still counts."""
    bench = _load_benchmark("bench_inference")
    rows = [{"contender": name, "lengths": lengths, "dtype": "fp32", "status": "ok", "ms_per_batch": ms,
             "vs_hf_sdpa": 100.0 / ms, "max_abs_diff_vs_hf_fp32": 1e-6}
            for lengths in ("fixed", "uniform")
            for name, ms in (("hf-sdpa", 100.0), ("rf-unpadded", 50.0), ("rf-int8", 20.0), ("onnxruntime", 60.0),
                             ("onnxruntime-int8", 40.0), ("onnxruntime-int8-7bit", 38.0))]
    cpu = torch.device("cpu")
    on_shape = {t["target"]: t for t in bench.evaluate_targets(rows, cpu)}
    off_shape = {t["target"]: t for t in bench.evaluate_targets(rows, cpu, off_target="batches of 1")}
    assert on_shape.keys() == off_shape.keys()
    for name, target in on_shape.items():
        if "max |diff|" in name:
            assert off_shape[name] == target and target["status"] == "met"
        else:
            assert target["status"] == "met", target
            assert off_shape[name]["status"] == "not measured (batches of 1)" and off_shape[name]["achieved"] is None


def test_table_shows_skipped_reason_and_ratio():
    rows = [_row("rf-fused", 300.0), _row("hf-eager", 200.0),
            {"contender": "hf-compile", "model": "base", "seq_len": 512, "dtype": "bf16", "batch": 8,
             "status": "skipped", "reason": "no compiler here"}]
    T.add_ratios(rows)
    table = T.format_table(rows)
    assert "skipped: no compiler here" in table
    assert f"{300 / 200:.2f}" in table.splitlines()[1]


def test_record_table_keeps_the_latest_gpu_run_per_device(tmp_path):
    (tmp_path / "README.md").write_text(f"# record\n\n{T.TABLE_START}\nold\n{T.TABLE_END}\n\ntail text\n")
    assert T.record_table(tmp_path) == "No GPU run recorded yet."

    def report(date, device_type, name, tps):
        rows = [_row("rf-fused", tps), _row("hf-eager", 100.0)]
        T.add_ratios(rows)
        env = {"date": date, "commit": "abcdef123456", "device": {"type": device_type, "name": name}}
        return {"schema": T.SCHEMA, "environment": env, "results": rows}

    for i, (date, kind, name, tps) in enumerate([("2026-01-01T00:00:00+00:00", "cuda", "GPU-A", 150.0),
                                                  ("2026-02-01T00:00:00+00:00", "cuda", "GPU-A", 170.0),
                                                  ("2026-03-01T00:00:00+00:00", "cpu", "x86_64", 5.0)]):
        T.write_report(tmp_path / f"throughput-{i}.json", report(date, kind, name, tps))
    kernel_env = {"date": "2026-02-02T00:00:00+00:00", "commit": "fedcba987654", "device": {"type": "cuda", "name": "GPU-A"}}
    T.write_report(tmp_path / "bench_attention-gpu-a-1.json", {"environment": kernel_env, "results": []})
    T.update_record_readme(tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("# record") and text.rstrip().endswith("tail text") and "old" not in text
    assert "2026-02-01" in text and "2026-01-01" not in text and "x86_64" not in text
    assert f"{170 / 100:.2f}" in text and "throughput-1.json" in text
    assert "| bench_attention | GPU-A | 2026-02-02 | fedcba98 | bench_attention-gpu-a-1.json |" in text


def test_kernel_benchmarks_record_themselves_where_the_record_table_finds_them(tmp_path, monkeypatch):
    """A full GPU run of a kernel benchmark (bench_fused_adam.py, ...) without --json names its record
    with _common.record_path; that name is one the record table lists (bench_<op>-<device>-<date>.json)."""
    bc = importlib.import_module("_common")
    gpu = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(bc, "device_facts", lambda device: dict(gpu))
    args = type("Args", (), {"json": None, "quick": False})()
    path = Path(bc.record_path(args, "fused_adam", torch.device("cuda")))
    assert path.parent == BENCH / "results"
    env = {"device": gpu, "commit": "abc1234", "date": "2026-11-28T04:00:00+00:00"}
    (tmp_path / path.name).write_text(json.dumps({"environment": env, "results": []}))
    assert f"| bench_fused_adam | {gpu['name']} | 2026-11-28 | abc1234 | {path.name} |" in T.record_table(tmp_path)


def test_throughput_on_a_named_gpu_makes_it_the_current_device(monkeypatch):
    """--device cuda:N: the CUDA events that time a block record on the current device's stream, so
    throughput.py makes GPU N the current device before anything runs (else it times GPU 0's stream)."""
    class Selected(Exception):
        pass

    def set_device(device):
        raise Selected(torch.device(device))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(Selected) as selected:
        T.main(["--quick", "--device", "cuda:1", "--no-record"])
    assert selected.value.args[0] == torch.device("cuda:1")


def test_record_readme_without_markers_is_an_error(tmp_path):
    (tmp_path / "README.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        T.update_record_readme(tmp_path)


def test_host_batches_are_packed_sequences():
    batches = T.HostBatches(vocab_size=100, batch=3, seq_len=9)
    b = batches.next()
    assert b.shape == (3, 9) and b.dtype == torch.int64
    assert (b[:, 0] == T.BOS).all() and (b[:, -1] == T.EOS).all() and (b[:, 4] == T.EOS).all()
    inner = b[:, 1:-1][b[:, 1:-1] != T.EOS]
    assert inner.min() > T.UNK and inner.max() < 99  # never a special id or <mask>
    example = batches.examples(b)[0]
    assert example["input_ids"] == b[0].tolist()
    assert example["special_tokens_mask"] == [int(i <= T.UNK) for i in b[0].tolist()]
    assert not torch.equal(batches.next(), b)  # cycles through distinct batches


def test_hf_tokenizer_has_roberta_ids():
    pytest.importorskip("transformers")
    tok = T.hf_tokenizer(300)
    assert (len(tok), tok.mask_token_id, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (300, 299, 1, 0, 2)


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--steps", "-1"], ["--compare", "/no/such/file.json"],
                                  ["--device", "tpu"], ["--contenders", "deepspeed"], ["--seq-lens", "0"]])
def test_bad_arguments_are_rejected(argv, capsys):
    with pytest.raises(SystemExit) as info:
        T.parse_args(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_atomic_write_leaves_nothing_behind_on_failure(tmp_path):
    target = tmp_path / "chart.svg"
    T.atomic_write(target, lambda tmp: tmp.write_text("<svg/>"))
    assert target.read_text() == "<svg/>"

    def broken(tmp):
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        T.atomic_write(target, broken)
    assert target.read_text() == "<svg/>" and list(tmp_path.iterdir()) == [target]


def test_profile_shares_add_up():
    args = T.parse_args(["--quick", "--warmup", "1"])
    prof = T.profile_step(T.Setting("tiny", 16, "fp32", 2), torch.device("cpu"), args, name="rf-reference")
    assert prof["clock"] == "cpu" and prof["total_ms_per_step"] > 0
    assert sum(prof["categories"].values()) == pytest.approx(1.0)
    shares = [op["share"] for op in prof["ops"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    assert prof["categories"].get("matmul", 0) > 0  # the encoder's linears ran


def test_sbo_contender_trains_both_heads_in_the_interpreter():
    """rf-fused+sbo (skipped on a CPU without --interpret) builds and steps: span masking
    returns boundaries, and the optimizer moves the SBO head as well as the encoder."""
    run = T.build_rf(T.Setting("tiny", 32, "fp32", 2), torch.device("cpu"), "fused", interpret=True, sbo=True)
    model = run.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    counts = [float(run.step()) for _ in range(2)]
    assert all(c > 0 for c in counts)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert any(n.startswith("sbo.") for n in moved) and any(n.startswith("roberta.") for n in moved)


def test_chart_without_matplotlib_is_svg(quick_report, tmp_path, monkeypatch):
    _, _, report = quick_report
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    message = T.throughput_chart(report, tmp_path / "chart.png")
    assert "PNG chart skipped" in message and not (tmp_path / "chart.png").exists()
    svg = (tmp_path / "chart.svg").read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    for r in report["results"]:
        assert r["contender"] in svg  # every contender is named in the legend


# ----------------------------------------------------------------- the kernels compile for GPUs
def _run_compiled(args, timeout=600):
    """Run from the repository root without Triton's interpreter (compile_report compiles for GPUs)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


_NO_REPORT = _load_benchmark("compile_report").triton_cannot_report()  # None where this Triton can report
needs_triton_knobs = pytest.mark.skipif(_NO_REPORT is not None, reason=f"compile_report {_NO_REPORT}")


ATTENTION_KERNELS = {"_attn_fwd_kernel", "_attn_bwd_preprocess_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"}
ELEMENTWISE_KERNELS = {"_bias_gelu_fwd_kernel", "_bias_gelu_bwd_kernel", "_layer_norm_fwd_kernel",
                       "_layer_norm_bwd_kernel", "_cross_entropy_fwd_kernel", "_cross_entropy_bwd_kernel"}


@needs_triton_knobs
def test_every_kernel_the_backend_launches_compiles_clean_for_v100_t4_a100_h100(tmp_path):
    """What the interpreter cannot check, on sm_70/75/80/90 at RoBERTa's head dim: each kernel the
    fused backend launches there builds, does its matrix work on tensor cores (mma / wgmma in the
    PTX) and spills no register in its autotuning-off config (or, where that one does, some
    autotune candidate is clean); the Triton attention is not launched below sm_80."""
    # a launch that leaves fp fusion to Triton's default (which 3.10 changes) is an error: Triton 3.9 warns
    proc = _run_compiled(["-W", "error:TRITON_DEFAULT_FP_FUSION", "benchmarks/compile_report.py",
                          "--default-configs", "--launched-only", "--head-dims", "64", "--jobs", "2",
                          "--json", str(tmp_path / "report.json")])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert {r["arch"] for r in rows} == {70, 75, 80, 90}
    for arch in (70, 75, 80, 90):
        here = [r for r in rows if r["arch"] == arch]
        assert {r["kernel"] for r in here} == ATTENTION_KERNELS | ELEMENTWISE_KERNELS, arch
        for r in here:
            if arch < 80 and r["kernel"] in ATTENTION_KERNELS:
                assert r["status"] == "not compiled" and not r["launched"], r
                continue
            assert r["status"] == "ok" and r["launched"] and r["registers"] > 0, r
            if r["kernel"] in ELEMENTWISE_KERNELS:
                assert r["dots"] == 0, r  # the claim that lets them run on every GPU
                if r["kernel"] == "_layer_norm_bwd_kernel":  # of the 4 programs per SM launched, two fit
                    warps = int(re.search(r"\bw(\d+)\b", r["config"]).group(1))  # at once in its
                    assert 2 * r["registers"] * 32 * warps <= 65536, r  # registers: its tile is sized so
            elif r["dots"]:
                assert (r["wgmma"] if arch == 90 else r["mma"]) > 0, r
        dtypes = {r["case"].split()[1] for r in here if r["kernel"].startswith("_attn") or "layer_norm" in r["case"]}
        assert ("bf16" in dtypes) == (arch >= 80), (arch, dtypes)  # no bf16 below sm_80: fp16 there
        # every attention variant the model launches, "plain" (no mask, no varlen, no dropout) being
        # each unpadded inference batch's
        variants = {r["case"].split()[-1] for r in here if r["kernel"] == "_attn_fwd_kernel"}
        assert variants == {"mask+dropout", "varlen+dropout", "dropout", "mask", "varlen", "plain"}, variants


def _captured_launch_script(arch: int, kernel: str) -> str:
    """Python source that binds `cr` (compile_report) and `launch`: the model's fp16 launch of `kernel`
    at head dim 64 / width 768, captured for sm_<arch>."""
    return ("import sys, torch; sys.path.insert(0, 'benchmarks'); import compile_report as cr\n"
            f"launch = next(la for la in cr.capture({arch}, {{'fp16': torch.float16}}, [64], [768])\n"
            f"              if la.kernel == {kernel!r})\n")


@needs_triton_knobs
def test_compile_report_fails_a_launched_dot_without_tensor_cores():
    """The check can fail: Triton's attention forward compiled for sm_75 does its dots on FMA (no mma);
    the report notes it while the dispatcher sends T4s to SDPA, and fails it if it were launched there."""
    script = _captured_launch_script(75, "_attn_fwd_kernel") + (
        "row = cr.default_config(launch, 75)\n"
        "row.launched = cr.launched(launch, 75)\n"
        "print(row.dots, row.mma, row.fma, row.launched, cr.problems(row), len(cr.failures([row])))\n"
        "row.launched = True\n"
        "print(cr.problems(row), len(cr.failures([row])))\n"
    )
    proc = _run_compiled(["-c", script])
    assert proc.returncode == 0, proc.stderr[-6000:]
    noted, failed = proc.stdout.strip().splitlines()[-2:]
    dots, mma, fma, launched, rest = noted.split(" ", 4)
    assert int(dots) > 0 and int(mma) == 0 and int(fma) > 0 and launched == "False", noted
    assert rest.startswith("['no-tensor-cores'") and rest.endswith("] 0"), noted  # noted (it spills too), not failed
    assert failed.startswith("['NO-TENSOR-CORES'") and failed.endswith("] 1"), failed


@needs_triton_knobs
def test_compile_report_reports_a_kernel_that_does_not_compile():
    """The check can fail: a LayerNorm launch with a block of 768 columns (not a power of two)."""
    script = _captured_launch_script(90, "_layer_norm_fwd_kernel") + (
        "fn = cr.importlib.import_module(launch.module)._layer_norm_fwd_kernel\n"
        "launch.constants[(fn.arg_names.index('BLOCK_N'),)] = 768\n"
        "row = cr.compile_one(launch, 90)\n"
        "print(row.status, row.registers)\n"
    )
    proc = _run_compiled(["-c", script])
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.split()[-2:] == ["error", "None"], proc.stdout


# ----------------------------------------------------------------- roofline.py
def _load_roofline():
    spec = importlib.util.spec_from_file_location("benchmarks_roofline", BENCH / "roofline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_roofline_matmul_flops_are_what_the_model_runs():
    """The roofline's matmul FLOPs (encoder + head, forward and both grads) equal what torch's
    FLOP counter sees in a real training step of the model, and its model FLOPs equal
    roberta_fast.model.training_flops."""
    from torch.utils.flop_counter import FlopCounterMode

    import roberta_fast as rf
    from roberta_fast.model import training_flops

    R = _load_roofline()
    cfg = rf.RobertaConfig.preset("tiny")
    batch, seq_len, predicted = 2, 16, 6
    model = rf.RobertaForMaskedLM(cfg, backend="reference")
    ids = torch.randint(5, cfg.vocab_size - 1, (batch, seq_len))
    labels = torch.full_like(ids, -100)
    labels.view(-1)[torch.randperm(batch * seq_len)[:predicted]] = 7
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=labels, masked_only=True).loss.backward()
    counts = counter.get_flop_counts()["Global"]
    linear = sum(n for op, n in counts.items() if str(op).split(".")[1] in ("mm", "addmm"))

    parts = {p.name: p for p in R.step_parts(cfg, batch, seq_len, predicted / (batch * seq_len))}
    assert parts["encoder matmuls"].flops + parts["MLM head matmuls"].flops == linear
    model_flops = sum(p.model_flops for p in parts.values())
    assert model_flops == training_flops(cfg, batch * seq_len, predicted, seq_len)


def test_roofline_report_adds_up(tmp_path):
    R = _load_roofline()
    assert R._gemm(2, 3, 4) == (48.0, (8 + 12 + 6) * 2)  # 2mnk FLOPs; A, B read and C written once
    out = tmp_path / "roofline.json"
    assert R.main(["--model", "base", "--seq-len", "512", "--batch", "32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["floor_ms"] == pytest.approx(sum(p["floor_ms"] for p in report["parts"]))
    optimizer = next(p for p in report["parts"] if p["name"].startswith("optimizer"))
    assert optimizer["bytes"] == 32 * 124_697_433  # roberta-base's parameters, 32 bytes each
    assert 0 < report["max_mfu"] < 1
    bf16 = R.report(R.RobertaConfig.preset("base"), 32, 512, 798, 3.0, 989, residual_bytes=2)
    assert bf16["floor_ms"] < report["floor_ms"]  # a 2-byte residual stream moves fewer bytes


@pytest.mark.parametrize("gpu, capability", [("h100", (9, 0)), ("a100", (8, 0)), ("v100", (7, 0)), ("t4", (7, 5))])
def test_roofline_models_the_attention_the_dispatcher_runs(monkeypatch, gpu, capability):
    """Each GPU's roofline counts the attention ops.attention_impl picks there (SDPA's below sm_80)."""
    import torch

    from roberta_fast import ops

    R = _load_roofline()
    monkeypatch.setattr(ops, "device_capability", lambda device: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    spec = R.GPUS[gpu]
    assert spec.attention == ops.attention_impl(torch.device("cuda"))
    cfg = R.RobertaConfig.preset("base")
    r = R.report(cfg, 32, 512, spec.matmul_tflops, spec.copy_tbs, spec.peak_tflops, attention=spec.attention)
    attention = next(p for p in r["parts"] if p["name"].startswith("attention"))
    unit = 2.0 * 32 * 512 * 512 * cfg.hidden_size * cfg.num_hidden_layers
    assert attention["flops"] == (9 if spec.attention == "triton" else 7) * unit
    assert attention["model_flops"] == 6 * unit
    assert 0 < r["max_mfu"] < 1
