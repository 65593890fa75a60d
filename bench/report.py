"""Write the results block of bench/README.md from bench/results/*.json (never typed by hand).

    python3 bench/report.py            # rewrites the block between the results markers
    python3 bench/report.py --check    # exit 1 if bench/README.md is out of date
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import paired_rounds  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
README = os.path.join(ROOT, "bench", "README.md")
START, END = "<!-- results:start (bench/report.py writes this) -->", "<!-- results:end -->"

OPS_VARIANTS = ("eager", "torch.compile", "compile+emulate", "bitfuse lossless", "bitfuse high")


def _cell(r):
    if r is None:
        return ""
    if "us" not in r:
        return "error"
    mark = "" if r["exact"] else " ≠"
    return f"{r['us']:.1f} ({r['pct_ceiling']:.0f}%){mark}"


def ops_section(path):
    res = json.load(open(path))
    rows = [r for r in res["rows"]]
    lines = [
        f"**Ops** — {res['gpu']}, torch {res['torch']}, triton {res['triton']}, {res['dtype']}, "
        f"copy ceiling {res['copy_ceiling_tbps']:.2f} TB/s measured in the same run ({res['date']}). "
        "Device µs per call (median of CUDA-graph replays over inputs several times the L2), in brackets "
        "the share of the copy ceiling; ≠ marks output that is not `torch.equal` "
        f"to eager. Source: `{os.path.relpath(path, ROOT)}`.",
        "",
        "Host cost of one call on tiny tensors (µs): " + "; ".join(
            f"{k} {v:.1f}" for k, v in res.get("host_us", {}).items()) + ".",
        "",
        "| op | D | S | params | " + " | ".join(OPS_VARIANTS) + " |",
        "|---|---|---|---|" + "---|" * len(OPS_VARIANTS),
    ]
    cases = []
    for r in rows:
        k = (r["op"], r["D"], r["S"], r["params"])
        if k not in cases:
            cases.append(k)
    for k in cases:
        cells = []
        for v in OPS_VARIANTS:
            cells.append(_cell(next((r for r in rows if (r["op"], r["D"], r["S"], r["params"]) == k
                                     and r["variant"] == v), None)))
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(cells) + " |")
    lines += against_compile(rows)
    return lines


def against_compile(rows, ops=("modulate", "gated_residual")):
    """The pointwise ops' lossless path against compile + emulate, round by round, next
    to the control: a second capture of compile + emulate against the first, which
    shows how far two timings of the same code differ in this run."""

    def pairs_of(variant):
        out = []
        for r in rows:
            if r["op"] in ops and r["variant"] == variant and "rounds_us" in r:
                c = next((c for c in rows if c["variant"] == "compile+emulate" and "rounds_us" in c
                          and all(c[k] == r[k] for k in ("op", "D", "S", "params"))), None)
                if c is not None:
                    out.append((r, c, paired_rounds(r["rounds_us"], c["rounds_us"])))
        return out

    def summary(pairs):
        slower = [r["us"] - c["us"] for r, c, _ in pairs if r["us"] > c["us"]]
        every = [(r, p) for r, c, p in pairs if p["rounds_slower"] == p["rounds"]]
        text = f"slower by the median at {len(slower)}" + (f" (by at most {max(slower):.2f} µs)" if slower else "")
        text += f", slower in every round at {len(every)}"
        if every:
            text += " (" + "; ".join(f"{r['op']} {r['D']}×{r['S']} {r['params']}, {p['median_diff_us']:+.2f} µs"
                                     for r, p in every) + ")"
        return text

    pairs = pairs_of("bitfuse lossless")
    if not pairs:
        return []
    n_rounds = pairs[0][2]["rounds"]
    text = (f"Pointwise ops against compile + emulate_precision_casts, {len(pairs)} shapes, {n_rounds} interleaved "
            f"rounds (slower in every round: one-sided sign test, p = 2^-{n_rounds}). bitfuse: " + summary(pairs))
    control = pairs_of("compile+emulate (control)")
    if control:
        gap = max(abs(p["median_diff_us"]) for _, _, p in control)
        beyond = [(r, p) for r, _, p in pairs if p["rounds_slower"] == p["rounds"] and p["median_diff_us"] > gap]
        text += (". Control, compile + emulate captured a second time against itself: " + summary(control) +
                 f"; its largest round-by-round gap is {gap:.2f} µs. bitfuse is slower in every round and by more "
                 f"than that gap at {len(beyond)} shapes")
        if beyond:
            text += " (" + "; ".join(f"{r['op']} {r['D']}×{r['S']} {r['params']}" for r, _ in beyond) + ")"
    return ["", text + "."]


def ltx2_section(path):
    res = json.load(open(path))
    cfg, v = res["config"], res["versions"]
    lines = [
        f"**LTX-2 transformer forward** — {res['gpu']}, torch {v.get('torch')}, triton {v.get('triton')}, "
        f"diffusers {v.get('diffusers')}; LTX-{cfg['variant']}, full width, {cfg['layers']} layers, "
        f"{cfg['video_tokens']} video + {cfg['audio_tokens']} audio + {cfg['text_tokens']} text tokens, "
        f"{cfg['dtype']}, batch {cfg['batch']} ({res['date']}). Median ms per forward over {cfg['iters']} calls. "
        f"Source: `{os.path.relpath(path, ROOT)}`.",
        "",
        "| timestep | mode | ms / forward | speedup vs eager | output elements differing from eager |",
        "|---|---|---|---|---|",
    ]
    for ts, modes in res["results"].items():
        for mode, r in modes.items():
            if "ms" not in r:
                lines.append(f"| {ts} | {mode} | error: {str(r.get('error', ''))[:80]} | | |")
                continue
            diff = "reference" if mode == "eager" else (
                f"{r['mismatches']:,} of {r['numel']:,}" if r.get("mismatches") is not None else "")
            lines.append(f"| {ts} | {mode} | {r['ms']:.2f} | {r.get('speedup', 0):.2f}x | {diff} |")
    for ts, modes in res["results"].items():
        split = []
        for mode, r in modes.items():
            k = r.get("kernels")
            if isinstance(k, dict) and "ms_per_forward" in k:
                m = k["ms_per_forward"]
                split.append(f"{mode}: GEMM {m['gemm']:.1f}, attention {m['attention']:.1f}, other {m['other']:.1f} ms")
        if split:
            lines += ["", f"Kernel time per forward ({ts}, torch.profiler): " + "; ".join(split) + "."]
    return lines


def accuracy_section(path):
    res = json.load(open(path))
    B, S, D = res["shape"]
    lines = [
        f"**Norm + modulate accuracy** — {res['gpu']}, torch {res['torch']}, triton {res['triton']}, "
        f"{S} x {D}, per-sample parameters. Error against the float64 value in ULPs at the scale of the "
        "modulate's largest term (mean / max), and how many elements differ from eager. high-r2 is the "
        "shipped high tier (eager's roundings, another summation order); high-r0 rounds once. "
        f"Source: `{os.path.relpath(path, ROOT)}`.",
        "",
        "| reference | dtype | rows | eager vs fp64 | lossless: differ from eager | high-r2 vs fp64 | high-r2: differ "
        "(max ULP) | high-r0 vs fp64 | high-r0: differ (max ULP) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["results"]:
        v = r["variants"]

        def err(name):
            return f"{v[name]['vs_fp64_mean_ulp']:.3f} / {v[name]['vs_fp64_max_ulp']:.2f}"

        def differ(name):
            return f"{v[name]['vs_eager_differ']:,} ({v[name]['vs_eager_max_ulp_at_term_scale']:g})"

        lines.append(f"| {r['reference']} | {r['dtype']} | {r['kind']} | {err('eager')} | "
                     f"{v['lossless']['vs_eager_differ']:,} | {err('high-r2')} | {differ('high-r2')} | "
                     f"{err('high-r0')} | {differ('high-r0')} |")
    return lines


def headline(ops_path, ltx2_path):
    """The few figures a reader wants first, from the same JSON as the tables."""
    lines = []
    if ltx2_path:
        res = json.load(open(ltx2_path))
        cfg = res["config"]
        for ts, modes in res["results"].items():
            def ms(m):
                return modes.get(m, {}).get("ms")

            def differ(m):
                r = modes.get(m, {})
                if r.get("mismatches") is None:
                    return ""
                return f"{r['mismatches']:,} of {r['numel']:,} elements differ"

            if ms("eager") is None or ms("bitfuse-lossless") is None:
                continue
            parts = [f"eager {ms('eager'):.1f} ms",
                     f"bitfuse lossless {ms('bitfuse-lossless'):.1f} ms "
                     f"({ms('eager') / ms('bitfuse-lossless'):.2f}x, {differ('bitfuse-lossless')})"]
            if ms("bitfuse-high") is not None:
                parts.append(f"high {ms('bitfuse-high'):.1f} ms ({differ('bitfuse-high')})")
            if ms("graphs-lossless") is not None:
                parts.append(f"lossless with CUDA graphs {ms('graphs-lossless'):.1f} ms")
            if ms("compile-regional") is not None:
                parts.append(f"regional torch.compile {ms('compile-regional'):.1f} ms ({differ('compile-regional')})")
            lines.append(f"- LTX-2, {cfg['layers']} layers, {cfg['video_tokens']} video tokens, {ts} timestep: "
                         + "; ".join(parts) + ".")
    if ops_path:
        rows = json.load(open(ops_path))["rows"]
        big = [r for r in rows if r["op"] in ("modulate", "gated_residual") and r["S"] >= 6144
               and r["variant"] == "bitfuse lossless" and "pct_ceiling" in r]
        if big:
            lo, hi = min(r["pct_ceiling"] for r in big), max(r["pct_ceiling"] for r in big)
            lines.append(f"- Modulate and gated residual at 6144 tokens and above: {lo:.0f}-{hi:.0f}% of the "
                         "copy ceiling, bit-exact.")
        norms = [r for r in rows if r["op"].endswith("+modulate") and r["params"] == "per-sample"
                 and r["variant"] in ("eager", "bitfuse lossless", "bitfuse high") and "us" in r]
        by_op = {}
        for r in norms:
            by_op.setdefault((r["op"], r["D"], r["S"]), {})[r["variant"]] = r
        for (op, D, S), v in by_op.items():
            if "eager" in v and "bitfuse lossless" in v:
                text = (f"- {op}, {S} x {D}, per-sample: eager {v['eager']['us']:.0f} us, lossless "
                        f"{v['bitfuse lossless']['us']:.1f} us ({v['bitfuse lossless']['pct_ceiling']:.0f}% of the "
                        f"ceiling, {'bit-exact' if v['bitfuse lossless']['exact'] else 'NOT exact'})")
                if "bitfuse high" in v:
                    text += f", high {v['bitfuse high']['us']:.1f} us ({v['bitfuse high']['pct_ceiling']:.0f}%)"
                lines.append(text + ".")
    return lines + ([""] if lines else [])


def render():
    ops = sorted(glob.glob(os.path.join(RESULTS, "ops-*.json")))
    ltx2 = [p for p in sorted(glob.glob(os.path.join(RESULTS, "ltx2-*.json"))) if "tokens" not in os.path.basename(p)]
    out = headline(ops[0] if ops else None, ltx2[0] if ltx2 else None)
    for path in sorted(glob.glob(os.path.join(RESULTS, "ops-*.json"))):
        out += ops_section(path) + [""]
    for path in sorted(glob.glob(os.path.join(RESULTS, "repeat", "ops-*.json"))):
        res = json.load(open(path))
        lines = against_compile(res["rows"])
        if lines:
            out += [f"Repeat run on {res['gpu']} ({res['date']}, `{os.path.relpath(path, ROOT)}`): "
                    + lines[-1][0].lower() + lines[-1][1:], ""]
    for path in sorted(glob.glob(os.path.join(RESULTS, "norm-accuracy-*.json"))):
        out += accuracy_section(path) + [""]
    for path in sorted(glob.glob(os.path.join(RESULTS, "ltx2-*.json"))):
        try:
            out += ltx2_section(path) + [""]
        except (KeyError, TypeError) as exc:
            out += [f"(could not read {os.path.relpath(path, ROOT)}: {exc})", ""]
    pngs = sorted(glob.glob(os.path.join(RESULTS, "*.png")))
    if pngs:
        out.append("Plots: " + ", ".join(f"[{os.path.basename(p)}]({os.path.relpath(p, os.path.dirname(README))})"
                                         for p in pngs))
    if not out:
        out = ["No results committed yet: run the benchmarks on a GPU (see above)."]
    return "\n".join(out).rstrip() + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = open(README).read()
    if START not in text or END not in text:
        sys.exit(f"{os.path.relpath(README, ROOT)} lacks the results markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = head + START + "\n" + render() + END + tail
    if args.check:
        sys.exit(0 if new == text else 1)
    open(README, "w").write(new)


if __name__ == "__main__":
    main()
