"""Bar chart of a throughput.py or bench_inference.py report: tokens/s per setting, one bar
per contender, labelled with its ratio to the report's peer (hf-eager for training
throughput, hf-sdpa for inference).

PNG through matplotlib when it is installed (`pip install matplotlib`); without it the
same chart is written as a dependency-free SVG beside the requested path, and the
message says so. Used by `throughput.py --chart PATH`; also runnable on a saved report:

    python benchmarks/plot.py results/throughput-....json chart.png
    python benchmarks/plot.py results/inference-cpu-....json chart.png
"""
from __future__ import annotations

import sys
from html import escape
from pathlib import Path

from roberta_fast.files import atomic_path

# One colour per contender of throughput.py and bench_inference.py, none shared (tests/test_plot.py):
# rf reds and pinks, rf int8 browns, hf blues and greens, onnxruntime greys and olives
COLORS = {"rf-fused": "#d62728", "rf-reference": "#ff9896", "rf-fused+sbo": "#9467bd",
          "hf-eager": "#1f77b4", "hf-compile": "#aec7e8", "hf-sdpa": "#2ca02c", "hf-patched": "#ff7f0e",
          "hf-int8": "#98df8a",
          "rf-unpadded": "#843c39", "rf-unpadded-whole": "#ad494a", "rf-padded": "#e7969c", "rf-compile": "#e377c2",
          "rf-prepacked": "#17becf", "rf-fp16-weights": "#9edae5",
          "rf-int8": "#8c564b", "rf-int8-7bit": "#c49c94", "rf-int8-whole": "#8c6d31", "rf-int8-fbgemm": "#bd9e39",
          "rf-int8-auto": "#e7ba52", "rf-int8-onnxruntime": "#ffbb78",
          "onnxruntime": "#7f7f7f", "onnxruntime-int8": "#bcbd22", "onnxruntime-int8-7bit": "#dbdb8d"}
# for names not listed above: colours none of them uses (matplotlib's cycle would repeat theirs)
SPARE = [c for c in ("#393b79", "#637939", "#7b4173", "#5254a3", "#8ca252", "#a55194", "#6b6ecf", "#b5cf6b",
                     "#ce6dbd", "#3182bd", "#31a354", "#756bb1", "#636363", "#e6550d") if c not in COLORS.values()]


def colors(contenders: list[str]) -> list[str]:
    """The colour of each contender: its own from COLORS, else the next spare one."""
    spare = iter(SPARE * (1 + len(contenders) // len(SPARE)))
    return [COLORS.get(c) or next(spare) for c in contenders]


def _is_inference(report: dict) -> bool:
    """bench_inference.py rows have a length distribution where throughput.py's have a model and seq_len."""
    return any("lengths" in r for r in report["results"])


def _peer(report: dict) -> str:
    return "hf-sdpa" if _is_inference(report) else "hf-eager"


def _setting(row: dict) -> str:
    if "lengths" in row:
        return f"{row['lengths']}/{row['dtype']}"
    return f"{row['model']}/{row['seq_len']}/{row['dtype']}"


def _series(report: dict):
    """(settings, contenders, {(setting, contender): tokens/s}) of the ok rows, in report order."""
    settings, contenders, value = [], [], {}
    for r in report["results"]:
        s = _setting(r)
        if s not in settings:
            settings.append(s)
        if r["contender"] not in contenders:
            contenders.append(r["contender"])
        if r["status"] == "ok":
            value[s, r["contender"]] = r["tokens_per_s"]
    return settings, contenders, value


def _title(report: dict) -> str:
    env = report["environment"]
    mlm = report.get("config", {}).get("head") == "RobertaForMaskedLM"  # bench_inference --head mlm
    what = f"{'MLM (encoder + head)' if mlm else 'encoder'} inference, real tokens/s" if _is_inference(report) \
        else "training throughput"
    device = env["device"]
    name = f"CPU ({device['name']}, {device['cores']} cores)" if device["type"] == "cpu" else device["name"]
    unverified = report.get("verification", {}).get("verified") is False  # throughput.py --gate
    return f"RoBERTa {what} - {name} - {env['date'][:10]}" + (" - UNVERIFIED" if unverified else "")


def _png(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings, listed, value = _series(report)
    contenders = [c for c in listed if any((s, c) in value for s in settings)]  # the rest: a footnote
    not_run = [c for c in listed if c not in contenders]
    peer_name = _peer(report)
    width = 0.8 / max(1, len(contenders))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(settings)) + 1.5, 4))
    for j, (c, color) in enumerate(zip(contenders, colors(contenders))):
        xs = [i + (j - (len(contenders) - 1) / 2) * width for i in range(len(settings))]
        heights = [value.get((s, c), 0.0) for s in settings]
        ax.bar(xs, heights, width, label=c, color=color)
        for x, s, h in zip(xs, settings, heights):  # the ratio to the peer over each bar
            peer = value.get((s, peer_name))
            if h and peer:
                ax.text(x, h, f"{h / peer:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(settings)), settings, rotation=20, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_title(_title(report), fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if not_run:
        fig.text(0.01, 0.01, "not run (skipped or failed, see the record): " + ", ".join(not_run), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # (path may be a temporary name without .png)
    plt.close(fig)


def _svg(report: dict) -> str:
    settings, contenders, value = _series(report)
    color = dict(zip(contenders, colors(contenders)))
    top = max(value.values(), default=1.0) or 1.0
    group, bar, h, left, base = 60 + 22 * len(contenders), 20, 240, 70, 280
    width = left + group * len(settings) + 160
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{base + 60}" font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="20" font-size="13">{escape(_title(report))}</text>',
           f'<line x1="{left}" y1="{base}" x2="{left + group * len(settings)}" y2="{base}" stroke="black"/>',
           f'<text x="10" y="{base - h}">{top:,.0f}</text><text x="10" y="{base}">0 tok/s</text>']
    for i, s in enumerate(settings):
        x0 = left + i * group + 10
        for j, c in enumerate(contenders):
            v = value.get((s, c))
            if v is None:  # skipped or failed: an empty slot, named in the legend
                continue
            hh = h * v / top
            out.append(f'<rect x="{x0 + j * (bar + 2)}" y="{base - hh:.1f}" width="{bar}" height="{hh:.1f}" '
                       f'fill="{color[c]}"><title>{escape(c)}: {v:,.0f} tokens/s</title></rect>')
        out.append(f'<text x="{x0}" y="{base + 16}">{escape(s)}</text>')
    for j, c in enumerate(contenders):
        y = 40 + 16 * j
        lx = left + group * len(settings) + 10
        out.append(f'<rect x="{lx}" y="{y - 10}" width="12" height="12" fill="{color[c]}"/>'
                   f'<text x="{lx + 16}" y="{y}">{escape(c)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def atomic_write(path: Path, write) -> None:
    """Call write(tmp_path) on a temporary file beside `path`, then rename it onto `path`,
    so that no reader ever sees half a file (the temporary is removed on failure) and the
    file has a plain write's permissions (roberta_fast.files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        write(tmp)


def throughput_chart(report: dict, path) -> str:
    """Write the chart to `path` (PNG) or, without matplotlib, beside it as SVG; returns what was done."""
    path = Path(path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        svg = path.with_suffix(".svg")
        atomic_write(svg, lambda p: p.write_text(_svg(report)))
        return f"PNG chart skipped: matplotlib is not installed (`pip install matplotlib`); wrote {svg}"
    atomic_write(path, lambda p: _png(report, p))
    return f"wrote {path}"


if __name__ == "__main__":
    import json

    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/plot.py REPORT.json CHART.png")
    print(throughput_chart(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]))
