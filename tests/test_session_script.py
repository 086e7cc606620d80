"""benchmarks/gpu_session.sh rehearsed on the CPU (GPU_SESSION_DRY=1), and what it feeds: the
correctness gate (benchmarks/gpu_gate.py) that marks throughput figures verified or not, and
`throughput.py --refresh-record STAGE.tgz` that records what a session hands back.

Every stage runs here with the flags it uses on the GPU at the smallest shapes, so a renamed
flag, a missing file or a broken summary fails CI, not the one GPU session.
"""
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
STAGES = ("first", "e2e", "test", "e2e-128", "sanitize", "kernels")
FOUR = ["rf-fused", "rf-reference", "hf-eager", "hf-compile"]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="gpu_session.sh needs bash and coreutils' timeout")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


T = _load("throughput")
G = sys.modules["gpu_gate"]  # throughput.py imports it from benchmarks/


def _session(stage, dest, **env):
    """The stage's dry run; the kernels stage on one benchmark (test_benchmarks.py runs each --quick --json)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GPU_SESSION_DRY": "1",
           "GPU_SESSION_BENCHES": "attention_dropout", "PYTHON": sys.executable, **env}  # this python, not PATH's
    return subprocess.run(["bash", str(SCRIPT), stage, str(dest)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def _members(archive):
    with tarfile.open(archive, "r:gz") as tar:
        return {Path(m.name).name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """Every stage's dry run, two at a time (CI has 2 cores): {stage: (process, archive members)}."""
    dest = tmp_path_factory.mktemp("session")
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = dict(zip(STAGES, pool.map(lambda s: _session(s, dest), STAGES)))
    return {s: (p, _members(dest / f"{s}.tgz") if (dest / f"{s}.tgz").exists() else {}) for s, p in procs.items()}


EXPECTED = {  # files each stage must hand back (dry shapes: tiny preset, seq 16)
    "first": ["gate.json", "throughput-tiny16-bf16.json", "throughput-tiny16-bf16.png",
              "roofline-tiny-16.json"],
    "e2e": ["gate.json", "throughput-tiny16-fp16.json", "throughput-tiny16-bf16.json"],
    "e2e-128": ["gate.json", "throughput-seq16-bf16.json"],
    "test": ["pytest-cuda.xml", "pytest-rest-1.xml", "pytest-rest-2.xml", "pytest-rest-3.xml", "pytest-emulated.xml"],
    "sanitize": ["sanitize-memcheck.xml", "sanitize-racecheck.xml"],
    "kernels": ["bench_attention_dropout.json", "compile_report.json"],
}


def skip_kernels_stage_without_triton_knobs():
    """The kernels stage runs the compile report, which only some Tritons can make."""
    why = _load("compile_report").triton_cannot_report()
    if why:
        pytest.skip(f"the kernels stage's compile report {why}")


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_runs_dry_and_packs_its_files(dry_runs, stage):
    if stage == "kernels":
        skip_kernels_stage_without_triton_knobs()
    proc, files = dry_runs[stage]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = files["summary.txt"].decode()
    for flag in ("FAILED", "CUT OFF", "SKIPPED"):
        assert flag not in summary, summary
    assert f"==== {stage} summary" in proc.stdout and "DRY RUN" in proc.stdout
    assert summary.strip().splitlines()[-1] in proc.stdout  # the summary is printed last
    assert "environment.txt" in files
    assert "extension: roberta_fast._C" in files["environment.txt"].decode()  # every stage: roberta_fast.info
    for name in EXPECTED[stage]:
        assert name in files and files[name], f"{stage} did not hand back {name}: {sorted(files)}"


def test_first_records_the_four_contenders_verified(dry_runs):
    _, files = dry_runs["first"]
    gate = json.loads(files["gate.json"])
    assert gate["schema"] == G.SCHEMA and gate["passed"] is True, gate["failures"]
    assert set(gate["setting"]["dtypes"]) == {"fp16", "bf16"}
    checked = {c["what"] for c in gate["results"]}
    assert "loss" in checked and sum(w.startswith("grad ") for w in checked) > 10  # every parameter's gradient
    report = json.loads(files["throughput-tiny16-bf16.json"])
    assert report["complete"] is True and report["verification"]["verified"] is True
    assert [r["contender"] for r in report["results"]] == FOUR
    assert report["profiles"], "--profile was given"


def test_e2e_times_the_peers_before_the_extras_within_the_estimate(dry_runs):
    """The e2e base run times hf-compile before rf-fused+sbo (and the profile, last): a cap cuts the
    extras, not a peer; and each throughput step's cap is at least the header's ~3.5 min estimate."""
    _, files = dry_runs["e2e"]
    report = json.loads(files["throughput-tiny16-fp16.json"])
    assert [r["contender"] for r in report["results"]] == FOUR + ["rf-fused+sbo"]
    stage = re.search(r"\n  e2e\)\n(.*?);;", SCRIPT.read_text(), re.S).group(1)
    caps = [int(cap) for cap in re.findall(r'throughput "[^"]+" (\d+)', stage)]
    assert len(caps) == 2 and min(caps) >= 210, caps


def test_test_stage_puts_the_cuda_cases_first_and_misses_no_file(dry_runs):
    _, files = dry_runs["test"]
    order = [line.split(":")[0] for line in files["summary.txt"].decode().splitlines() if line.startswith("pytest-")]
    assert order[0] == "pytest-cuda" and order[-1] == "pytest-emulated"
    parts = [files[name[:-4] + ".log"].decode() for name in EXPECTED["test"]]
    listed = {line.split("::")[0] for log in parts for line in log.splitlines() if line.startswith("tests/")}
    assert listed == {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}


def test_failed_gate_marks_the_figures_unverified(tmp_path, monkeypatch):
    """A fused model that disagrees with the reference fails the gate, and the throughput run given
    that gate keeps its figures, marked unverified (JSON, terminal and record table)."""
    build = G.build_models

    def broken(*args):  # the fused model computes something else than the reference
        reference, fused = build(*args)
        with torch.no_grad():
            for p in fused.parameters():
                p.mul_(1.5)
        return reference, fused

    monkeypatch.setattr(G, "build_models", broken)
    gate = tmp_path / "gate.json"
    assert G.main(["--model", "tiny", "--seq-len", "16", "--batch", "1", "--dtypes", "fp16", "--skip-tests",
                   "--json", str(gate)]) == 1
    verdict = json.loads(gate.read_text())
    assert verdict["passed"] is False and any(" grad roberta." in f for f in verdict["failures"])
    report_path = tmp_path / "run.json"
    assert T.main(["--models", "tiny", "--seq-lens", "16", "--batch", "1", "--dtypes", "fp32", "--warmup", "0",
                   "--steps", "1", "--repeats", "1", "--device", "cpu", "--contenders", "rf-reference",
                   "--no-record", "--gate", str(gate), "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["results"][0]["status"] == "ok" and report["results"][0]["tokens_per_s"] > 0  # kept
    v = report["verification"]
    assert v["verified"] is False and v["reason"].startswith("the correctness gate failed")
    report["environment"]["device"].update(type="cuda", name="NVIDIA H100 80GB HBM3")  # as if on the GPU
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "throughput-h100-1.json").write_text(json.dumps(report))
    row = next(li for li in T.record_table(tmp_path / "results").splitlines() if "rf-reference" in li)
    assert "**no**: the correctness gate failed" in row


def test_dry_gate_runs_on_the_device_the_dry_figures_are_timed_on(tmp_path, monkeypatch):
    """The test stage runs this rehearsal ON the GPU machine, where the dry figures are timed on the
    CPU (--device cpu): the dry gate must run there too, or throughput.py --gate sees another device
    and leaves them unverified (test_first_records_the_four_contenders_verified would fail there)."""
    monkeypatch.setattr(G.bc, "default_device", lambda: torch.device("cuda"))  # as on the GPU machine
    gate = tmp_path / "gate.json"
    assert G.main(["--model", "tiny", "--seq-len", "16", "--batch", "1", "--dtypes", "fp16", "--device", "cpu",
                   "--json", str(gate)]) == 0
    assert T.verification(gate, T.environment(torch.device("cpu")))["verified"] is True
    dry_gate, dry_timing = (re.search(rf"{name}=\(([^)]*)\)", SCRIPT.read_text()).group(1)  # the first: dry
                            for name in ("gate_shape", "timing"))
    assert "--device cpu" in dry_gate and "--device cpu" in dry_timing


def test_gate_cut_off_during_its_cuda_tests_keeps_the_model_check(tmp_path, monkeypatch):
    """The session's SIGINT at the gate step's cap, during the CUDA tests, still leaves gate.json:
    the model check, and a failed verdict saying the tests gave none; and the session gives the
    gate a tests timeout inside that cap (gpu_gate.py's own default, 300 s, is over it)."""
    monkeypatch.setattr(G.bc, "environment", lambda device: {"device": {"type": "cuda", "name": "H100"}, "commit": "x"})
    monkeypatch.setattr(G, "model_gate", lambda *args: [{"dtype": "bf16", "what": "loss", "error": 0.0,
                                                         "allowed": 1.0, "ok": True}])

    def cut(junit, timeout):  # the step's cap arrives while the CUDA tests run
        raise KeyboardInterrupt

    monkeypatch.setattr(G, "cuda_tests", cut)
    gate = tmp_path / "gate.json"
    with pytest.raises(KeyboardInterrupt):
        G.main(["--model", "tiny", "--seq-len", "16", "--batch", "1", "--dtypes", "bf16", "--device", "cuda",
                "--json", str(gate)])
    verdict = json.loads(gate.read_text())
    assert [c["what"] for c in verdict["results"]] == ["loss"] and verdict["passed"] is False
    assert verdict["failures"] == ["CUDA tests: no verdict (the gate was stopped during the CUDA tests)"]
    body = re.search(r"\ngate\(\) \{(.*?)\n\}", SCRIPT.read_text(), re.S).group(1)
    assert "--tests-timeout $((cap * slow - 90))" in body


def test_verification_needs_a_passed_gate_of_this_device_and_commit(tmp_path):
    env = T.environment(torch.device("cpu"))
    assert T.verification(None, env)["verified"] is False
    assert "did not run" in T.verification(tmp_path / "gate.json", env)["reason"]
    (tmp_path / "bad.json").write_text("{")
    assert "unreadable" in T.verification(tmp_path / "bad.json", env)["reason"]
    gate = {"schema": G.SCHEMA, "environment": json.loads(json.dumps(env)), "passed": True, "failures": []}
    (tmp_path / "gate.json").write_text(json.dumps(gate))
    assert T.verification(tmp_path / "gate.json", env)["verified"] is True
    for key, value in (("commit", "0123abc"), ("device", {**env["device"], "name": "other"})):
        (tmp_path / "other.json").write_text(json.dumps({**gate, "environment": {**env, key: value}}))
        assert T.verification(tmp_path / "other.json", env)["verified"] is False


def test_gate_tolerances_are_the_fused_model_tests():
    """The gate uses exactly the autocast tolerances of tests/test_fused_model.py."""
    source = (ROOT / "tests" / "test_fused_model.py").read_text()
    found = re.findall(r"tol = \{torch\.float16: ([0-9.e-]+), torch\.bfloat16: ([0-9.e-]+)\}\[dtype\]", source)
    assert found and {(float(a), float(b)) for a, b in found} == {(G.TOLERANCE["fp16"], G.TOLERANCE["bf16"])}


def test_gate_runs_existing_cuda_tests():
    """The gate's CUDA tests exist (on a CPU the gate does not run them; the dry sanitize stage
    runs the same files and selection)."""
    assert all((ROOT / path).is_file() for path in G.CUDA_TESTS)
    assert G.CUDA_SELECTION in SCRIPT.read_text()


def _as_gpu_archive(files, path, extra=()):
    """The dry run's archive rewritten as a GPU run's, plus `extra` (name, bytes) members."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in [*files.items(), *extra]:
            report = json.loads(data) if name.endswith(".json") else None
            if report and "device" in report.get("environment", {}):
                report["environment"]["device"].update(type="cuda", name="NVIDIA H100 80GB HBM3")
                data = json.dumps(report).encode()
            info = tarfile.TarInfo(name if "/" in name else f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_refresh_record_takes_the_returned_archives(dry_runs, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "README.md").write_text(f"# record\n\n{T.TABLE_START}\nold\n{T.TABLE_END}\n")
    _, first = dry_runs["first"]
    _, kernels = dry_runs["kernels"]
    archive = tmp_path / "first.tgz"
    _as_gpu_archive(first, archive, extra=[("../escape.json", b'{"environment": {}}')])
    _as_gpu_archive(kernels, tmp_path / "kernels.tgz")
    lines = T.import_session(archive, results) + T.import_session(tmp_path / "kernels.tgz", results)
    names = sorted(p.name for p in results.iterdir())
    slug = "nvidia-h100-80gb-hbm3"
    record = [n for n in names if n.startswith(f"throughput-{slug}-") and n.endswith(".json")]
    assert len(record) == 1 and record[0].replace(".json", ".png") in names  # the chart beside it
    assert any(n.startswith(f"gate-{slug}-") for n in names)
    assert any(n.startswith(f"bench_attention_dropout-{slug}-") for n in names)
    assert not (tmp_path / "escape.json").exists() and not any("escape" in n for n in names)
    assert any("roofline-tiny-16.json: kept in the archive only" in li for li in lines)
    T.update_record_readme(results)
    table = (results / "README.md").read_text()
    assert "| yes |" in table and "old" not in table and "bench_attention_dropout" in table
    assert T.import_session(archive, results) and sorted(p.name for p in results.iterdir()) == names  # idempotent
    with pytest.raises(SystemExit, match="not a gpu_session.sh STAGE.tgz"):
        T.import_session(results / "README.md", results)


def test_a_dry_archive_is_not_recorded(dry_runs, tmp_path):
    _, first = dry_runs["first"]
    archive = tmp_path / "first.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in first.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    lines = T.import_session(archive, tmp_path)
    assert any("not a GPU run" in li for li in lines) and not list(tmp_path.glob("throughput-*"))


def test_refresh_record_rejects_a_missing_archive(capsys):
    with pytest.raises(SystemExit):
        T.parse_args(["--refresh-record", "no-such-first.tgz"])
    assert "no such file no-such-first.tgz" in capsys.readouterr().err


def test_a_spent_budget_skips_steps_and_still_packs(tmp_path):
    proc = _session("sanitize", tmp_path, GPU_SESSION_BUDGET_S="20")
    assert proc.returncode == 0, proc.stderr
    summary = _members(tmp_path / "sanitize.tgz")["summary.txt"].decode()
    assert "sanitize-memcheck: not run (the stage's 20 s budget is spent)" in summary


def _rows(archive):
    """The contenders of the first stage's throughput report in `archive` (none while there is none)."""
    report = _members(archive).get("throughput-tiny16-bf16.json") if archive.exists() else None
    return [r["contender"] for r in json.loads(report)["results"]] if report else []


def test_a_stage_killed_mid_step_hands_back_the_rows_it_measured(tmp_path):
    """The device kills the whole command at its limit (SIGKILL: no trap runs), in the middle of a
    step: the rows throughput.py had written by then are in what is left under $OUT, packed while
    the step runs, not lost with the stage's temporary folder."""
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    python = tmp_path / "python"  # throughput.py runs to its end, then its step hangs on until killed
    python.write_text(f'#!/bin/sh\n"{sys.executable}" "$@"; rc=$?\ncase "$*" in *benchmarks/throughput.py*)\n'
                      f'  touch "{ready}"; while [ ! -e "{stop}" ]; do sleep 0.2; done;;\nesac\nexit $rc\n')
    python.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GPU_SESSION_DRY": "1",
           "PYTHON": str(python), "GPU_SESSION_PACK_S": "1", "TMPDIR": str(tmp_path / "tmp")}
    out, log = tmp_path / "out", tmp_path / "session.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", str(SCRIPT), "first", str(out)], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not ready.exists():  # every contender's row written; the step still running
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        deadline = time.monotonic() + 60  # for the packer (every second here) to pack them
        while len(_rows(out / "first.tgz")) < len(FOUR):
            assert time.monotonic() < deadline, f"not packed while the step ran: {_rows(out / 'first.tgz')}"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)  # as the device, at the call's limit
        proc.wait()
    finally:
        stop.touch()  # ends the step's hanging stand-in, in its own process group
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert _rows(out / "first.tgz") == FOUR  # what is left after the kill
    assert "throughput-tiny16-bf16:" not in _members(out / "first.tgz")["summary.txt"].decode()  # killed in that step


def test_kernels_stage_runs_only_gpu_benchmarks_that_exist():
    """The kernels stage's default list names existing scripts and leaves out bench_preprocess: a CPU
    benchmark that at full size cannot finish under the stage's 75 s cap (it burnt the call's budget)."""
    default = re.search(r"GPU_SESSION_BENCHES:-([a-z_ ]+)\}", SCRIPT.read_text()).group(1).split()
    assert default and "preprocess" not in default
    for bench in default:
        name = "attention" if bench == "attention_dropout" else bench
        assert (ROOT / "benchmarks" / f"bench_{name}.py").is_file(), bench


def test_kernels_stage_compile_report_is_the_one_ci_runs(dry_runs):
    """On the GPU the compile report compiles only the configs that run with autotuning off
    (--default-configs, as CI: 176 compiles, under a minute on 16 cores); every config is 704,
    over its step cap, and it writes its JSON only at the end, so nothing would come back."""
    skip_kernels_stage_without_triton_knobs()
    stage = re.search(r"\n  kernels\)\n(.*?);;", SCRIPT.read_text(), re.S).group(1)
    command = re.search(r"run compile_report \d+ (.*?)--json", stage, re.S).group(1)  # without the dry extras
    assert "--default-configs" in command and "--launched-only" in command
    _, files = dry_runs["kernels"]
    assert "--default-configs" in json.loads(files["compile_report.json"])["argv"]


@pytest.mark.parametrize("name, capability, column", [("NVIDIA H200", (9, 0), "h200"),
                                                     ("NVIDIA H100 80GB HBM3", (9, 0), "h100"),
                                                     ("Tesla V100-SXM2-16GB", (7, 0), "v100")])
def test_roofline_ceilings_are_picked_by_the_gpus_name(tmp_path, name, capability, column):
    """An H100 and an H200 are both sm_90: the session's probe picks the roofline's column by the
    GPU's name (an H200's memory is 4.3 TB/s against the H100's 3.0), and roofline.py has it."""
    probe = re.search(r"read -r auto_dtype roofline_gpu < <\(\"\$py\" - 2>/dev/null <<'EOF'\n(.*?)\nEOF\n",
                      SCRIPT.read_text(), re.S).group(1)
    (tmp_path / "sitecustomize.py").write_text(  # torch.cuda answers as that GPU would
        "import types, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        f"torch.cuda.get_device_name = lambda *a, **k: {name!r}\n"
        f"torch.cuda.get_device_capability = lambda *a, **k: {capability!r}\n"
        f"torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(name={name!r}, "
        f"major={capability[0]}, minor={capability[1]})\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, "-"], input=probe, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["fp16" if capability < (8, 0) else "bf16", column]
    R = _load("roofline")
    assert R.gpu_of(name, capability) == column and column in R.GPUS
    if column == "h200":
        assert R.GPUS["h200"].copy_tbs > R.GPUS["h100"].copy_tbs and "4.8 TB/s" in R.GPUS["h200"].source


def test_environment_probe_runs_without_git(tmp_path):
    """The device image may lack git: the probe still writes the commit (ROBERTA_FAST_COMMIT) and
    the package list, which the script reads for its 'packages missing' line."""
    probe = re.search(r'>"\$out/environment.txt" 2>&1 <<\'EOF\'\n(.*?)\nEOF\n', SCRIPT.read_text(), re.S).group(1)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)  # a PATH with python and no git
    env = {**os.environ, "PATH": str(tmp_path / "bin"), "PYTHONPATH": str(ROOT), "ROBERTA_FAST_COMMIT": "0123abcd"}
    proc = subprocess.run([sys.executable, "-", "0"], input=probe, cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "commit 0123abcd" in proc.stdout.splitlines() and "  pytest " in proc.stdout, proc.stdout


def test_unknown_stage_is_a_one_line_error(tmp_path):
    proc = _session("e2e-more", tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: unknown stage 'e2e-more'; choose one of: {' '.join(STAGES)}")


# tokenizers is a declared dependency (pyproject.toml) and on the GPU image; the script's environment
# check names it if it is ever missing
BARE = ("transformers", "safetensors", "onnx", "onnxruntime", "pytest_benchmark", "xdist",
        "matplotlib", "yaml", "huggingface_hub", "peft", "datasets", "pyarrow", "zstandard")


def test_the_suite_collects_on_a_bare_torch_image(tmp_path):
    """What a bare torch image may lack: with those packages hidden, every test file still
    imports (the tests that need one skip, naming it), so the test stage does not stop."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        f"BLOCKED = {set(BARE)!r}\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (hidden)', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and " error" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "(hidden)" in proc.stdout  # the packages were hidden, and the tests needing them skip
