#!/usr/bin/env python3
"""Draws docs/figures/overview.svg, the README's picture (plain SVG, no dependencies):

    python3 tools/draw_overview.py            # rewrites docs/figures/overview.svg
    python3 tools/draw_overview.py OUT.svg    # somewhere else (tests/test_docs_figure.py compares)

Left: the two layouts of one virtual KV cache and the physical pages behind a page index. Right: a schematic of
two engines' mapped KV memory on one GPU over time, against a static split (the shapes are drawn, not measured;
the measured timeline is benchmarks/results/serving_timeline_h200.png).
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "docs" / "figures" / "overview.svg"
W, H = 960, 380
A_COL, B_COL, K_COL, V_COL, FREE, INK, MUTED = "#4878d0", "#ee854a", "#6acc64", "#d65f5f", "#eeeeee", "#222", "#777"


def rect(x: float, y: float, w: float, h: float, fill: str, stroke: str = "#fff", dash: str = "") -> str:
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" fill="{fill}" stroke="{stroke}"{extra}/>'


def text(x: float, y: float, s: str, size: int = 12, anchor: str = "start", fill: str = INK, weight: str = "") -> str:
    bold = f' font-weight="{weight}"' if weight else ""
    return f'<text x="{x:g}" y="{y:g}" font-size="{size}" text-anchor="{anchor}" fill="{fill}"{bold}>{s}</text>'


def layouts(x0: float, y0: float) -> list[str]:
    """Two layers, blocks 0-7, a page index = blocks 0-3 or 4-7 of every layer; page index 0 mapped, 1 not."""
    out = [text(x0, y0, "One virtual KV cache, two layouts", 15, weight="bold"),
           text(x0, y0 + 18, "a page index (4 blocks here) is mapped only while one of its blocks holds tokens",
                11, fill=MUTED)]
    cell, mapped = 22, range(4)
    # contiguous: [blocks, layers, K/V, block]
    y = y0 + 50
    out.append(text(x0, y - 8, "contiguous  [blocks, layers, K/V, block]: one map call a page for all layers", 12))
    sub, gap = 13, 4
    for b in range(8):
        bx = x0 + b * (4 * sub + gap)
        for i, (layer, kv) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
            out.append(rect(bx + i * sub, y, sub, 26, (K_COL, V_COL)[kv] if b in mapped else FREE))
            if b == 0:
                out.append(text(bx + i * sub + sub / 2, y + 38, f"{'KV'[kv]}{layer}", 9, "middle", MUTED))
        out.append(text(bx + 2 * sub, y - 0 + 17, str(b), 11, "middle", "#fff" if b in mapped else MUTED, "bold"))
    page_w = 4 * (4 * sub + gap) - gap
    out.append(rect(x0 - 1, y - 2, page_w + 2, 30, "none", INK))
    out.append(text(x0 + 4 * sub + gap, y + 38, "(block 0: K and V of layers 0 and 1)", 9, fill=MUTED))
    out.append(text(x0 + page_w / 2, y + 56, "page index 0: mapped", 11, "middle"))
    out.append(text(x0 + page_w + gap + page_w / 2, y + 56, "page index 1: no memory", 11, "middle", MUTED))
    # per-layer: one tensor per layer [K/V, blocks, block]
    y = y0 + 168
    out.append(text(x0, y - 20, "per-layer  [K/V, blocks, block] per layer: dense per layer, as vendor kernels need",
                    12))
    for layer in range(2):
        x = x0
        yy = y + layer * 34
        out.append(text(x0 - 6, yy + 17, f"L{layer}", 10, "end", MUTED))
        for kv, col in enumerate((K_COL, V_COL)):
            for b in range(8):
                out.append(rect(x, yy, cell * 0.82, 26, col if b in mapped else FREE))
                out.append(text(x + cell * 0.41, yy + 17, str(b), 10, "middle", "#fff" if b in mapped else MUTED))
                x += cell * 0.82
            if layer == 0:
                out.append(text(x - 4 * cell * 0.82, yy - 4, ("K", "V")[kv], 10, "middle", MUTED))
            x += 8
        for kv in range(2):
            out.append(rect(x0 + kv * (8 * cell * 0.82 + 8) - 1, yy - 1, 4 * cell * 0.82 + 2, 28, "none", INK))
    out.append(text(x0, y + 82, "page index 0 = the outlined ranges: one allocation sliced over every layer's K and V",
                    11, fill=MUTED))
    return out


def engines(x0: float, y0: float) -> list[str]:
    """Stacked mapped memory of engines A and B over time, a static split's line, the GPU's KV budget."""
    w, h = 360, 220
    top, base = y0 + 40, y0 + 40 + h
    out = [text(x0, y0, "Memory follows load across engines", 15, weight="bold"),
           text(x0, y0 + 18, "schematic: two engines on one GPU, bursts at different times", 11, fill=MUTED)]
    # A: burst early, B: burst late; each a small idle floor
    t = [i / 40 for i in range(41)]

    def burst(s: float, start: float, end: float, peak: float) -> float:
        """Idle floor, a ramp up as requests arrive, a plateau, a ramp down as they finish."""
        ramp = (end - start) / 4
        if s <= start or s >= end:
            return 0.06
        return 0.06 + peak * min(1.0, (s - start) / ramp, (end - s) / ramp)

    a = [burst(s, 0.04, 0.5, 0.74) for s in t]
    b = [burst(s, 0.5, 0.96, 0.74) for s in t]

    def pt(i: int, v: float) -> str:
        return f"{x0 + t[i] * w:.1f},{base - v * h:.1f}"

    a_top = [pt(i, a[i]) for i in range(len(t))]
    ab_top = [pt(i, a[i] + b[i]) for i in range(len(t))]
    out.append(f'<polygon points="{x0:g},{base:g} {" ".join(a_top)} {x0 + w:g},{base:g}" fill="{A_COL}" '
               'fill-opacity="0.85"/>')
    out.append(f'<polygon points="{" ".join(a_top)} {" ".join(reversed(ab_top))}" fill="{B_COL}" '
               'fill-opacity="0.85"/>')
    out.append(f'<line x1="{x0:g}" y1="{top:g}" x2="{x0 + w:g}" y2="{top:g}" stroke="{INK}"/>')
    out.append(text(x0 + w, top - 4, "GPU memory for KV", 10, "end"))
    half = base - 0.5 * h
    out.append(f'<line x1="{x0:g}" y1="{half:g}" x2="{x0 + w:g}" y2="{half:g}" stroke="{INK}" '
               'stroke-dasharray="6,4"/>')
    out.append(text(x0 + 4, half - 5, "static split: A's fixed half below, B's above", 10))
    out.append(f'<line x1="{x0:g}" y1="{base:g}" x2="{x0 + w:g}" y2="{base:g}" stroke="{INK}"/>')
    out.append(f'<line x1="{x0:g}" y1="{base:g}" x2="{x0:g}" y2="{top:g}" stroke="{INK}"/>')
    out.append(text(x0 + w, base + 16, "time", 11, "end"))
    out.append(rect(x0 + 8, base + 26, 12, 12, A_COL))
    out.append(text(x0 + 26, base + 36, "engine A's mapped KV", 11))
    out.append(rect(x0 + 170, base + 26, 12, 12, B_COL))
    out.append(text(x0 + 188, base + 36, "engine B's mapped KV", 11))
    out.append(text(x0, base + 58, "a burst may use more than half; an idle engine gives its pages back", 11,
                    fill=MUTED))
    return out


def svg() -> str:
    body = layouts(40, 30) + engines(550, 30)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
            'font-family="Helvetica, Arial, sans-serif">\n'
            f'{rect(0, 0, W, H, "#ffffff", "none")}\n' + "\n".join(body) + "\n</svg>\n")


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out.write_text(svg(), encoding="utf-8")
    print(out)
