"""Prefill throughput against sequence length: every ResLin rule beside flash attention and FLA's GDN.

For T = 2K, 4K, ..., 128K at B = 1 (bf16, H heads, D = head size) it times one forward without
gradient of `reslin_attention(..., backend="triton")` for every rule, of causal
`scaled_dot_product_attention` restricted to its flash backend ([B, H, T, D]), and of FLA
0.6.0's `chunk_gated_delta_rule` when FLA is importable, and reports tokens/s = B * T / time
(median of --repeats after warm-up). This is the RLA paper's Fig. 2, which gave no numbers:
linear attention should keep its throughput as T grows while attention's falls as 1 / T.
Writes prefill.csv and prefill.svg (log2 T on x, tokens/s on y) into --out.

Goal (issue "Bundled Triton kernels for inference"): the figure and its numbers; no threshold.

    python benchmarks/bench_prefill.py [--lengths 2048 ... 131072] [--heads 16] [--dim 128]
                                       [--rules ...] [--repeats 10] [--out benchmarks/results]
    python benchmarks/bench_prefill.py --smoke   # tiny sizes; runs on a CPU (Triton interpreter, fp32)
"""

import argparse
import csv
import math
import os
import tempfile

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import DEVICE, DTYPE, REPO, RULES, import_fla, median_ms, print_header, rule_inputs
from kernels_reslin import reslin_attention

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf"]


def methods(fla, rules, T, H, D):
    """{name: zero-argument forward} for length T, B = 1, fresh inputs each."""
    calls = {}
    for rule in rules:
        x = rule_inputs(rule, 1, T, H, D)
        calls[f"ResLin {rule}"] = lambda x=x: reslin_attention(**x, backend="triton")
    q, k, v = (torch.randn(1, H, T, D, device=DEVICE, dtype=DTYPE) for _ in range(3))

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    calls["SDPA flash"] = sdpa
    if fla is not None:
        x = rule_inputs("gdn", 1, T, H, D)
        calls["FLA chunk GDN"] = lambda: fla.ops.gated_delta_rule.chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"])
    return calls


def length_label(T):
    return f"{T // 1024}K" if T % 1024 == 0 else str(T)


def si(value):
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:g}{suffix}"
    return f"{value:g}"


def nice_step(top, ticks=5):
    """A 1, 2 or 5 times a power of ten giving at most `ticks` intervals up to `top`."""
    raw = top / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def write_svg(path, lengths, throughput, title):
    """A line chart without plotting libraries: x = log2 T, y = tokens/s, one polyline per method."""
    width, height, left, right, top, bottom = 760, 460, 80, 190, 40, 50
    plot_w, plot_h = width - left - right, height - top - bottom
    x_lo, x_hi = math.log2(lengths[0]), math.log2(lengths[-1])
    highest = max(max(series) for series in throughput.values())
    step = nice_step(highest)
    y_hi = step * math.ceil(highest / step)
    x_of = lambda T: left + plot_w * ((math.log2(T) - x_lo) / (x_hi - x_lo) if x_hi > x_lo else 0.5)  # noqa: E731
    y_of = lambda v: top + plot_h * (1 - v / y_hi)  # noqa: E731

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{left + plot_w / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>']
    for i in range(round(y_hi / step) + 1):
        y = y_of(i * step)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{si(i * step)}</text>')
    for T in lengths:
        x = x_of(T)
        parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + plot_h}" stroke="#eee"/>')
        parts.append(f'<text x="{x:.1f}" y="{top + plot_h + 18}" text-anchor="middle">{length_label(T)}</text>')
    parts.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 10}" text-anchor="middle">'
                 'sequence length T (log2 scale)</text>')
    parts.append(f'<text transform="translate(18 {top + plot_h / 2}) rotate(-90)" text-anchor="middle">tokens/s</text>')
    for i, (name, series) in enumerate(throughput.items()):
        color = COLORS[i % len(COLORS)]
        points = [(x_of(T), y_of(v)) for T, v in zip(lengths, series)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                     + " ".join(f"{x:.1f},{y:.1f}" for x, y in points) + '"/>')
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in points]
        legend_y = top + 10 + 20 * i
        parts.append(f'<line x1="{left + plot_w + 15}" y1="{legend_y}" x2="{left + plot_w + 40}" y2="{legend_y}" '
                     f'stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{left + plot_w + 46}" y="{legend_y + 4}">{name}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048 * 2**i for i in range(7)])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", help="folder for prefill.csv and prefill.svg (default benchmarks/results; "
                                      "a fresh temporary folder under --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script itself")
    args = parser.parse_args()
    if args.smoke:
        args.lengths, args.heads, args.dim, args.repeats = [32, 64], 2, 32, 1
    out = args.out or (tempfile.mkdtemp(prefix="bench_prefill_") if args.smoke
                       else os.path.join(REPO, "benchmarks", "results"))
    os.makedirs(out, exist_ok=True)

    fla = import_fla()
    H, D = args.heads, args.dim
    print_header(f"prefill forward, B=1, H={H} D={D}, {str(DTYPE).removeprefix('torch.')}, "
                 f"tokens/s = T / median time of {args.repeats} after warm-up")
    lengths = sorted(args.lengths)
    throughput, rows = {}, []
    for T in lengths:
        with torch.no_grad():
            for name, call in methods(fla, args.rules, T, H, D).items():
                ms = median_ms(call, args.repeats)
                throughput.setdefault(name, []).append(T / (ms / 1e3))
                rows.append((T, name, ms, T / (ms / 1e3)))
        if T == lengths[0]:
            print(f"{'T':>6} " + " ".join(f"{name:>15}" for name in throughput) + "   (tokens/s)")
        print(f"{length_label(T):>6} " + " ".join(f"{series[-1]:15,.0f}" for series in throughput.values()),
              flush=True)

    csv_path, svg_path = os.path.join(out, "prefill.csv"), os.path.join(out, "prefill.svg")
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["T", "method", "ms", "tokens_per_s"])
        writer.writerows((T, name, f"{ms:.4f}", f"{tps:.1f}") for T, name, ms, tps in rows)
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    write_svg(svg_path, lengths, throughput, f"Prefill throughput, B=1, H={H}, D={D} ({device})")
    print(f"wrote {csv_path} and {svg_path}")


if __name__ == "__main__":
    main()
