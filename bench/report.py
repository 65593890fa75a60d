"""Write the results block of bench/README.md, and the summary table of the top
README.md, from bench/results/*.json (never typed by hand).

    python -m bench.report            # rewrites the blocks between the markers
    python -m bench.report --check    # exit 1 if either README is out of date

Reads the JSON of bench/models.py ("bench": "models"), bench/ops.py (ops-*.json,
and repeat/ops-*.json for the round-by-round comparison) and bench/norm_accuracy.py
(norm-accuracy-*.json). Earlier runs in a retired format sit in results/archive/
and are not rendered. Standard library only (CI runs `--check` without torch).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
README = os.path.join(ROOT, "bench", "README.md")
START, END = "<!-- results:start (bench/report.py writes this) -->", "<!-- results:end -->"
TOP_README = os.path.join(ROOT, "README.md")
TOP_START, TOP_END = "<!-- summary:start (bench/report.py writes this) -->", "<!-- summary:end -->"

OPS_VARIANTS = ("eager", "torch.compile", "compile+emulate", "bitfuse lossless", "bitfuse high")
POINTWISE = ("modulate", "gated_residual")
MODE_LABELS = {"eager": "eager", "lossless": "lossless", "high": "high", "graphs": "lossless + CUDA graphs",
               "compile": "regional torch.compile"}


def _load(path):
    with open(path) as f:
        return json.load(f)


def _src(path):
    return f"`{os.path.relpath(path, ROOT)}`"


def paired_rounds(a: list, b: list) -> dict:
    """Round-by-round comparison of two variants' per-round medians (`a`, `b`: one
    value a round, from the same interleaved run): the median difference a - b,
    and in how many rounds a was slower. "slower in every round" has probability
    2**-rounds if neither is faster (one-sided sign test)."""
    diffs = [x - y for x, y in zip(a, b)]
    return dict(median_diff_us=round(statistics.median(diffs), 3), rounds=len(diffs),
                rounds_slower=sum(d > 0 for d in diffs))


# ---------------------------------------------------------------- ops


def _layout(r):
    return r.get("layout", r.get("params"))  # (runs before the spec-driven bench/ops.py called it "params")


def _key(r):
    return (r["op"], r["D"], r["S"], _layout(r))


def _cell(r):
    if r is None:
        return ""
    if "us" not in r:
        return "error"
    return f"{r['us']:.1f} ({r['pct_ceiling']:.0f}%)" + ("" if r.get("exact") else " ≠")


def _host_text(host: dict) -> str:
    if all(isinstance(v, dict) for v in host.values()):  # per op: {variant: us}
        return "; ".join(f"{op}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()) for op, row in host.items())
    return "; ".join(f"{k} {v:.1f}" for k, v in host.items())


def ops_section(path):
    res = _load(path)
    rows = res["rows"]
    lines = [
        f"**Ops** — {res['gpu']}, torch {res['torch']}, triton {res['triton']}, {res['dtype']}, copy ceiling "
        f"{res['copy_ceiling_tbps']:.2f} TB/s measured in the same run ({res['date']}). Device µs per call (median "
        "of CUDA-graph replays over inputs several times the L2), in brackets the share of the copy ceiling; ≠ marks "
        f"output that is not bitwise equal to eager's. Source: {_src(path)}.",
        "",
        "Host cost of one call on tiny tensors (µs): " + _host_text(res.get("host_us", {})) + ".",
        "",
        "| op | D | S | layout | " + " | ".join(OPS_VARIANTS) + " |",
        "|---|---|---|---|" + "---|" * len(OPS_VARIANTS),
    ]
    for k in dict.fromkeys(_key(r) for r in rows):
        cells = [_cell(next((r for r in rows if _key(r) == k and r["variant"] == v), None)) for v in OPS_VARIANTS]
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(cells) + " |")
    if res.get("skipped"):
        lines += ["", f"Not run (time budget): {', '.join(res['skipped'])}."]
    return lines + against_compile(rows)


def against_compile(rows, ops=POINTWISE):
    """The pointwise ops' lossless path against compile + emulate, round by round, next
    to the control: a second capture of compile + emulate against the first, which
    shows how far two timings of the same code differ in this run."""

    def pairs_of(variant):
        out = []
        for r in rows:
            if r["op"] in ops and r["variant"] == variant and "rounds_us" in r:
                c = next((c for c in rows if c["variant"] == "compile+emulate" and "rounds_us" in c
                          and _key(c) == _key(r)), None)
                if c is not None:
                    out.append((r, c, paired_rounds(r["rounds_us"], c["rounds_us"])))
        return out

    def name(r):
        return f"{r['op']} {r['D']}×{r['S']} {_layout(r)}"

    def summary(pairs):
        slower = [r["us"] - c["us"] for r, c, _ in pairs if r["us"] > c["us"]]
        every = [(r, p) for r, c, p in pairs if p["rounds_slower"] == p["rounds"]]
        text = f"slower by the median at {len(slower)}" + (f" (by at most {max(slower):.2f} µs)" if slower else "")
        text += f", slower in every round at {len(every)}"
        if every:
            text += " (" + "; ".join(f"{name(r)}, {p['median_diff_us']:+.2f} µs" for r, p in every) + ")"
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
            text += " (" + "; ".join(name(r) for r, _ in beyond) + ")"
    return ["", text + "."]


# ---------------------------------------------------------------- norm accuracy


def accuracy_section(path):
    res = _load(path)
    B, S, D = res["shape"]
    lines = [
        f"**Norm + modulate accuracy** — {res['gpu']}, torch {res['torch']}, triton {res['triton']}, {B} × {S} × {D}, "
        f"parameters `{res['layout']}`. Error against the float64 value of the same expression in ULPs at the scale "
        "of its largest term (mean / max), elements differing bitwise from eager (largest ULP distance), and whether "
        f"the high contract (`numerics.high_contract`) holds. Source: {_src(path)}.",
        "",
        "| reference | dtype | rows | eager vs fp64 | lossless: differ from eager | high vs fp64 | high: differ from "
        "eager (max ULP) | high contract |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        v = r["variants"]

        def err(name):
            m = v.get(name, {})
            return m.get("error", f"{m.get('mean_ulp', 0):.3f} / {m.get('max_ulp', 0):.2f}")

        def differ(name, ulp=False):
            m = v.get(name, {})
            if "differ_from_eager" not in m:
                return m.get("error", "")
            return f"{m['differ_from_eager']:,}" + (f" ({m['max_ulp_from_eager']})" if ulp else "")

        lines.append(f"| {r['reference']} | {r['dtype']} | {r['data']} | {err('eager')} | {differ('lossless')} | "
                     f"{err('high')} | {differ('high', ulp=True)} | {v.get('high', {}).get('high_contract', '')} |")
    return lines


# ---------------------------------------------------------------- models


def _f(v, fmt, suffix=""):
    return "" if v is None else format(v, fmt) + suffix


def _split(r):
    k = (r.get("kernels") or {}).get("ms")
    if not k:
        return "not traced" if (r.get("kernels") or {}).get("note") else ""
    return f"{k['gemm']:.1f} / {k['attention']:.1f} / {k['other']:.1f} ({r['kernels']['bitfuse_ms']:.1f})"


def _gpu(r):
    g = r.get("gpu") or {}
    clock, power = (g.get("sm_clock_mhz") or {}).get("median"), (g.get("power_w") or {}).get("median")
    return f"{clock:.0f} MHz, {power:.0f} W" if clock is not None else ""


def _differ(mode, r):
    if mode == "eager":
        return "reference" if not r.get("differing") else f"{r['differing']:,} (eager against itself)"
    return "" if r.get("differing") is None else f"{r['differing']:,} of {r['numel']:,}"


def _depth(cfg) -> str:
    """The model's depth as its config states it: "48 layers", "19 double + 38 single layers"."""
    model = cfg.get("model") or {}
    n = model.get("num_layers") or cfg.get("layers")
    if not n:
        return ""
    single = model.get("num_single_layers")
    return f"{n} double + {single} single layers" if single else f"{n} layers"


def models_section(path):
    res = _load(path)
    cfg, v = res["config"], res["versions"]
    lines = [
        f"**{res['preset']}** ({res.get('about', '')}) — {res['gpu']}, torch {v.get('torch')}, triton "
        f"{v.get('triton')}, diffusers {v.get('diffusers')}; {_depth(cfg)}, batch {cfg['batch']}, "
        f"{cfg['dtype']}, {cfg['rounds']} interleaved rounds × {cfg['per_round']} forwards per mode ({res['date']}, "
        f"{res['status']}). `{res['command']}`. Source: {_src(path)}.",
    ]
    if res.get("cold_start"):
        cs = res["cold_start"]
        parts = []
        for phase in ("cold", "warm"):
            r = cs.get(phase, {})
            got = [f"{m} {r[m]['first_call_s']:.1f} s" + (f" (second {r[m]['second_call_s']:.1f} s)" if "second_call_s" in r[m] else "")
                   for m in ("lossless", "compile") if isinstance(r.get(m), dict) and "first_call_s" in r[m]]
            parts.append(f"{phase} caches: " + (", ".join(got) if got else f"failed ({r.get('error')})"))
        lines += ["", "First call in a fresh process (`--cold-start`): " + "; ".join(parts) + "."]
    for name, w in res["workloads"].items():
        lines += ["", f"*{name}*: {w.get('describe', '')}. Inputs: "
                  + ", ".join(f"{k} {'×'.join(map(str, s))}" for k, s in w.get("inputs", {}).items()) + ".", "",
                  "| mode | ms / forward (min – p90) | vs eager | vs compile | elements differing from eager | "
                  "first call s | peak GiB | kernel ms: GEMM / attention / other (bitfuse) | SM clock, power | "
                  "gate verdicts |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for mode, r in w["modes"].items():
            label = MODE_LABELS.get(mode, mode)
            if "skipped" in r or "error" in r:
                lines.append(f"| {label} | {'skipped' if 'skipped' in r else 'failed'}: "
                             f"{(r.get('skipped') or r.get('error'))[:100]} | | | | | | | | |")
                continue
            ms = (f"{r['ms']:.2f} ({r['ms_min']:.2f} – {r['ms_p90']:.2f})" if r.get("ms") is not None else "")
            verdicts = ", ".join(f"{n} {k}" for k, n in (r.get("verdicts") or {}).items())
            lines.append(f"| {label} | {ms} | {_f(r.get('speedup_vs_eager'), '.2f', '×')} | "
                         f"{_f(r.get('speedup_vs_compile'), '.2f', '×')} | {_differ(mode, r)} | "
                         f"{_f(r.get('first_call_s'), '.1f')} | {_f(r.get('peak_mem_gib'), '.1f')} | {_split(r)} | "
                         f"{_gpu(r)} | {verdicts} |")
        lines += _host_line(w["modes"])
    for note in res.get("notes", []):
        lines += ["", f"Note: {note}"]
    return lines


def _host_line(modes: dict) -> list[str]:
    """The host's state over the rounds and each mode's CPU time a forward (runs that
    record them): a busy host stretches the host-bound modes, the CPU time does not."""
    loads = [v for r in modes.values() for v in r.get("load_1min", [])]
    cpu = [f"{MODE_LABELS.get(m, m)} {r['cpu_ms']:.2f}" for m, r in modes.items() if r.get("cpu_ms") is not None]
    if not loads or not cpu:
        return []
    return ["", f"Host: load average (1 min) {min(loads):.1f}–{max(loads):.1f} over the rounds; the thread's CPU "
            "time a forward until the call returns (no sync), median ms: " + ", ".join(cpu) + "."]


# ---------------------------------------------------------------- headline


def headline(ops_path, models_paths):
    """The few figures a reader wants first, from the same JSON as the tables."""
    lines = []
    for path in models_paths:
        res = _load(path)
        for name, w in res["workloads"].items():
            m = w["modes"]

            def ms(mode):
                return m.get(mode, {}).get("ms")

            if ms("eager") is None or ms("lossless") is None:
                continue
            parts = [f"eager {ms('eager'):.1f} ms"]
            for mode in ("lossless", "graphs", "high", "compile"):
                if ms(mode) is not None:
                    r = m[mode]
                    parts.append(f"{MODE_LABELS[mode]} {ms(mode):.1f} ms ({r['speedup_vs_eager']:.2f}×"
                                 + (f", {_differ(mode, r)} elements differ" if r.get("differing") is not None else "")
                                 + ")")
            lines.append(f"- {res['preset']}, {_depth(res['config'])}, {name} ({w.get('describe', '')}): "
                         + "; ".join(parts) + ".")
    if ops_path:
        rows = _load(ops_path)["rows"]
        big = [r for r in rows if r["op"] in POINTWISE and r["S"] >= 6144 and r["variant"] == "bitfuse lossless"
               and "pct_ceiling" in r]
        if big:
            lo, hi = min(r["pct_ceiling"] for r in big), max(r["pct_ceiling"] for r in big)
            exact = "bit-exact" if all(r.get("exact") for r in big) else "NOT all bit-exact"
            lines.append(f"- Modulate and gated residual at 6144 tokens and above: {lo:.0f}-{hi:.0f}% of the copy "
                         f"ceiling, {exact}.")
        by_case = {}
        for r in rows:
            if "norm" in r["op"] and "modulate" in r["op"] and "us" in r and r["variant"] in OPS_VARIANTS:
                by_case.setdefault(_key(r), {})[r["variant"]] = r
        for (op, D, S, layout), v in by_case.items():
            if layout not in ("per-sample", "unbind-sample") or "eager" not in v or "bitfuse lossless" not in v:
                continue
            ll = v["bitfuse lossless"]
            text = (f"- {op}, {S} × {D}, {layout}: eager {v['eager']['us']:.0f} µs, lossless {ll['us']:.1f} µs "
                    f"({ll['pct_ceiling']:.0f}% of the ceiling, {'bit-exact' if ll.get('exact') else 'NOT exact'})")
            if "bitfuse high" in v:
                text += f", high {v['bitfuse high']['us']:.1f} µs ({v['bitfuse high']['pct_ceiling']:.0f}%)"
            lines.append(text + ".")
    return lines + ([""] if lines else [])


def summary(models_paths) -> str:
    """The top README's table: one row a model workload, its speed-ups and exactness."""
    lines = ["| model, shape (one H200 unless named) | eager | lossless | lossless + CUDA graphs | regional torch.compile |",
             "|---|---|---|---|---|"]

    def cell(r, exact_word):
        if not r or r.get("ms") is None:
            return "not run"
        text = f"{r['ms']:.0f} ms, {r['speedup_vs_eager']:.2f}×"
        if r.get("speedup_vs_compile") is not None:
            text += f" ({r['speedup_vs_compile']:.2f}× compile)"
        if r.get("differing") is not None:
            text += f", {exact_word}" if r["differing"] == 0 else f", {r['differing']:,} of {r['numel']:,} differ"
        return text

    for path in models_paths:
        res = _load(path)
        cfg = res["config"]
        for name, w in res["workloads"].items():
            m = w["modes"]
            if (m.get("eager") or {}).get("ms") is None:
                continue
            what = res.get("about") or res["preset"]
            if _depth(cfg) and "layers" not in what:
                what += f", {_depth(cfg)}"
            if f"B={cfg['batch']}" not in what:
                what += f", B={cfg['batch']}"
            what += "" if name == "default" else f", {name}"
            if "H200" not in res.get("gpu", "H200"):
                what += f", on one {res['gpu'].replace('NVIDIA ', '')}"
            if res.get("status") != "complete":
                what += " (run cut short by its time limit after these rows)"
            compile_cell = cell(m.get("compile"), "bit-exact")
            lines.append(f"| {what} | {m['eager']['ms']:.0f} ms | {cell(m.get('lossless'), 'bit-exact')} | "
                         f"{cell(m.get('graphs'), 'bit-exact')} | {compile_cell} |")
    if len(lines) == 2:
        return "No model results committed yet.\n"
    return "\n".join(lines) + "\n"


def _replace(text: str, start: str, end: str, body: str) -> str | None:
    if start not in text or end not in text:
        return None
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + "\n" + body + end + tail


def render():
    def found(pattern):
        return sorted(glob.glob(os.path.join(RESULTS, pattern)))

    models = [p for p in found("*.json") if _load(p).get("bench") == "models"]
    ops = found("ops-*.json")
    out = headline(ops[0] if ops else None, models)
    for path in models:
        out += models_section(path) + [""]
    for path in ops:
        out += ops_section(path) + [""]
    for path in found(os.path.join("repeat", "ops-*.json")):
        res = _load(path)
        lines = against_compile(res["rows"])
        if lines:
            out += [f"Repeat run on {res['gpu']} ({res['date']}, {_src(path)}): " + lines[-1][0].lower()
                    + lines[-1][1:], ""]
    for path in found("norm-accuracy-*.json"):
        out += accuracy_section(path) + [""]
    pngs = found("*.png")
    if pngs:
        out.append("Plots: " + ", ".join(f"[{os.path.basename(p)}]({os.path.relpath(p, os.path.dirname(README))})"
                                         for p in pngs))
    if not out:
        out = ["No results committed yet: run the benchmarks on a GPU (see above)."]
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if either README is out of date")
    args = ap.parse_args(argv)
    models = [p for p in sorted(glob.glob(os.path.join(RESULTS, "*.json"))) if _load(p).get("bench") == "models"]
    stale = False
    for path, start, end, body, required in ((README, START, END, render, True),
                                             (TOP_README, TOP_START, TOP_END, lambda: summary(models), False)):
        text = open(path).read() if os.path.exists(path) else ""
        new = _replace(text, start, end, body())
        if new is None:
            if required:
                print(f"{os.path.relpath(path, ROOT)} lacks the results markers", file=sys.stderr)
                return 2
            continue
        if new != text:
            stale = True
            if not args.check:
                with open(path, "w") as f:
                    f.write(new)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
