"""benchmarks/plot.py: the bar chart of a throughput.py or bench_inference.py report."""
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import plot  # noqa: E402

ENV = {"device": {"type": "cpu", "name": "x86_64", "cores": 2}, "date": "2026-11-25T00:00:00"}


def inference_report():
    rows = [{"contender": c, "lengths": lengths, "dtype": "fp32", "status": "ok", "tokens_per_s": tps}
            for lengths, values in (("uniform", {"hf-sdpa": 100.0, "rf-unpadded": 180.0}),
                                    ("fixed", {"hf-sdpa": 50.0, "rf-unpadded": 55.0}))
            for c, tps in values.items()]
    rows.append({"contender": "onnxruntime", "lengths": "fixed", "dtype": "fp32", "status": "failed"})
    return {"environment": ENV, "results": rows}


def test_inference_report_is_charted_per_length_mix_against_hf_sdpa():
    report = inference_report()
    settings, contenders, value = plot._series(report)
    assert settings == ["uniform/fp32", "fixed/fp32"]
    assert contenders == ["hf-sdpa", "rf-unpadded", "onnxruntime"]
    assert value["uniform/fp32", "rf-unpadded"] == 180.0 and ("fixed/fp32", "onnxruntime") not in value
    assert plot._peer(report) == "hf-sdpa"
    assert "CPU (x86_64, 2 cores)" in plot._title(report) and "inference" in plot._title(report)


def test_throughput_report_keeps_hf_eager_as_its_peer():
    row = {"contender": "rf-fused", "model": "base", "seq_len": 512, "dtype": "bf16", "status": "ok",
           "tokens_per_s": 1.0}
    report = {"environment": {"device": {"type": "cuda", "name": "H100"}, "date": "2026-11-25"}, "results": [row]}
    assert plot._series(report)[0] == ["base/512/bf16"] and plot._peer(report) == "hf-eager"
    assert "training throughput - H100" in plot._title(report)


def test_inference_chart_is_written(tmp_path):
    message = plot.throughput_chart(inference_report(), tmp_path / "chart.png")
    written = [p for p in (tmp_path / "chart.png", tmp_path / "chart.svg") if p.exists() and p.stat().st_size > 0]
    assert written, message


def _contenders(name):
    """The CONTENDERS of benchmarks/<name>.py."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module.CONTENDERS


def test_every_contender_has_its_own_colour():
    """Listed contenders never share a colour, and unlisted ones take colours none of them has
    (matplotlib's default cycle repeated hf-eager's blue and hf-sdpa's green)."""
    names = sorted(set(_contenders("throughput")) | set(_contenders("bench_inference")))
    assert set(names) <= set(plot.COLORS)
    assert len(set(plot.COLORS.values())) == len(plot.COLORS)
    unknown = [f"new-{i}" for i in range(len(plot.SPARE) + 2)]
    chosen = plot.colors(names + unknown)
    assert chosen[:len(names)] == [plot.COLORS[n] for n in names]
    spare = chosen[len(names):]
    assert not set(spare) & set(plot.COLORS.values()) and len(set(spare[:len(plot.SPARE)])) == len(plot.SPARE)
