"""Op benchmark: every op in `bitfuse.ops.SPECS`, each tier with a kernel and each
parameter layout it declares, against eager, torch.compile and torch.compile with
`emulate_precision_casts`, timed in one run on one GPU next to the copy ceiling.

    python -m bench.ops                # every op x layout at 1 x 6144 x 4096 bf16 (~3-4 min)
    python -m bench.ops --quick        # each op's first layout only (~1 min)
    python -m bench.ops --sweep        # + D in {2048, 4096} x S in {1024, 6144, 24576} for the first two layouts
    python -m bench.ops --widths 3072,5120   # + the first layout at model widths, as many elements as the main shape
    python -m bench.ops --ops modulate,gated_residual --budget 170

Operands come from each spec's `make_args(cases.Case(...))` (randn draws). Variants:
eager (`spec.reference`), torch.compile and compile + emulate_precision_casts of the
same reference, a second, separately captured copy of compile + emulate (the
control: how far two timings of the same code differ), and bitfuse per tier
(`policy.gated(spec, tier, spec.plan(...), args)` as a site calls it, first-sight
verification included).

Each variant: median device microseconds per call (bench/timing.py: CUDA-graph replay
over input sets several times the L2, three captures per variant pooled, variants
in 8 interleaved rounds with the median of each round kept in `rounds_us`),
achieved TB/s over the bytes the op must move (each operand read once, the output
written once) and its share of the copy ceiling measured in the same run. Rows are
checked bitwise against eager on the first input set (`numerics.same_bits`,
`differing`, max ULP); a bitfuse row checks the kernel's own output (its launch into
a NaN-poisoned buffer) and records the gate's verdicts, and a high row whether
`numerics.high_contract` holds. Host cost per call (plan, gate, launch) is measured
on tiny tensors. Writes bench/results/ops-<gpu>.json after every case (a run cut
short keeps what it measured) and a PNG.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time

import torch

from bench.timing import (
    GraphTimer,
    copy_ceiling_tbps,
    host_us,
    interleaved_samples,
    pooled_rounds,
    sets_for,
)
from bitfuse import numerics, policy
from bitfuse.ops import SPECS, cases, conv_epilogue

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MAIN_SHAPE = (1, 6144, 4096)
SWEEP_SHAPES = [(1, S, D) for D in (4096, 2048) for S in (1024, 6144, 24576)]
HOST_SHAPE = (1, 8, 256)
CONTROL = "compile+emulate (control)"
INSTANCES = 3  # captures per variant, pooled
MEMORY_OPS = [name for name, spec in SPECS.items() if spec.bandwidth_bound]  # the copy ceiling is their yardstick
ROUNDS = 8


def variants(spec) -> list[str]:
    return ["eager", "torch.compile", "compile+emulate", CONTROL] + [f"bitfuse {t}" for t in spec.tiers]


def plan_cases(specs, quick: bool = False, sweep: bool = False, widths=()) -> list[tuple]:
    """(spec, layout, (B, S, D)) for every op to time: each declared layout at the
    main shape (`quick`: the first layout only); `sweep` adds SWEEP_SHAPES for the
    first two layouts; each of `widths` adds the first layout at (1, S, D), S the rows
    that hold the main shape's elements (FLUX's 3072, Wan's 5120)."""
    out = []
    B, S, D = MAIN_SHAPE
    for spec in specs:
        layouts = spec.layouts[:1] if quick else spec.layouts
        out += [(spec, layout, MAIN_SHAPE) for layout in layouts]
        if sweep:
            out += [(spec, layout, shape) for layout in spec.layouts[:2] for shape in SWEEP_SHAPES
                    if shape != MAIN_SHAPE]
        out += [(spec, spec.layouts[0], (1, B * S * D // w, w)) for w in widths if w != D]
    return out


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor an argument holds: itself, a tuple's or list's items, or the
    attributes of a slotted parameter object (a Folded table row and temb)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_in(o)]
    return [t for name in getattr(type(obj), "__slots__", ()) for t in tensors_in(getattr(obj, name, None))]


def bytes_moved(args, out) -> int:
    """Bytes each operand must be read once (a view: its own elements) and the
    output written once; an operand passed twice (shared frequencies) counts once."""
    seen, total = set(), 0
    for t in tensors_in(args) + tensors_in(out):
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def compile_fn(fn, emulate: bool):
    """torch.compile of `fn`; with `emulate`, Inductor keeps eager's intermediate roundings.
    Each call makes its own backend, so the variants never share a cache entry."""
    return torch.compile(fn, dynamic=False, options={"emulate_precision_casts": emulate})


def allow_many_recompiles():
    """Every case compiles the same few references: lift Dynamo's per-function cache
    limit so none silently falls back to eager."""
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 4096)


def bitfuse_call(spec, tier: str, args: tuple):
    """A call as a site makes it: plan (the guard), then the gate."""
    kernel_tier = spec.kernel_tier(tier)

    def call():
        return policy.gated(spec, kernel_tier, spec.plan(*args, tier=tier), args)

    return call


def check(out, ref) -> dict:
    """Bitwise comparison with eager (tuples: summed over their items)."""
    pairs = list(zip(out, ref)) if isinstance(ref, tuple) else [(out, ref)]
    return dict(exact=all(numerics.same_bits(o, r) for o, r in pairs),
                differing=sum(numerics.differing(o, r) for o, r in pairs),
                max_ulp=max(numerics.max_ulp(o, r) for o, r in pairs))


def _poisoned(ref):
    if isinstance(ref, tuple):
        return tuple(_poisoned(r) for r in ref)
    return torch.full(ref.shape, float("nan"), dtype=ref.dtype, device=ref.device)


def check_bitfuse(spec, tier: str, args: tuple, ref) -> dict:
    """The kernel's own output (launched into a NaN-poisoned buffer) against eager,
    the high contract for a high kernel, and the gate's verdicts for this path."""
    kernel_tier = spec.kernel_tier(tier)
    plan = spec.plan(*args, tier=tier)
    if plan.__class__ is str:
        return dict(error=f"no kernel for this case (eager fallback): {plan}")
    result = check(spec.launch[kernel_tier](plan, out=_poisoned(ref)), ref)
    if kernel_tier == "high" and spec.reference64 is not None:
        out = spec.launch["high"](plan, out=_poisoned(ref))
        why = numerics.high_contract(out, ref, spec.reference64(*args), spec.terms(*args))
        result["high_contract"] = why or "holds"
    policy.reset_verdicts()
    bitfuse_call(spec, tier, args)()
    result["verdicts"] = sorted({v.status for v in policy.verdicts()})
    return result


def measure(names, call, sets, compare) -> dict:
    """Check each variant on the first input set (`compare(name)` -> dict), capture
    INSTANCES timers of it over all sets (variants in turn, so that no variant's
    buffers are all allocated first), time all of them in interleaved rounds.
    {variant: dict with "us", "rounds_us" and the comparison, or "error"}."""
    results, timers = {}, {}
    for name in names:
        try:
            results[name] = compare(name)
        except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the rest
            results[name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
    for i in range(INSTANCES):
        for name in names:
            if "error" in results[name]:
                continue
            try:
                with torch.no_grad():
                    timers[(name, i)] = GraphTimer([call(name, args) for args in sets])
            except Exception as exc:  # noqa: BLE001
                results[name] = dict(error=f"capture: {type(exc).__name__}: {exc}"[:300])
    for key in [k for k in timers if "error" in results[k[0]]]:
        timers.pop(key).close()
    for name, per_round in pooled_rounds(interleaved_samples(timers, rounds=ROUNDS, replays=3)).items():
        results[name]["us"] = statistics.median(v for r in per_round for v in r)
        results[name]["rounds_us"] = [round(statistics.median(r), 3) for r in per_round]
    for t in timers.values():
        t.close()
    return results


def run_case(spec, layout: str, shape: tuple, ceiling: float, dtype=torch.bfloat16) -> list[dict]:
    B, S, D = shape

    def make(seed):
        return spec.make_args(cases.Case(B, S, D, dtype, layout, "randn", seed, "cuda"))

    probe = make(0)
    ref = spec.reference(*probe)
    moved = bytes_moved(probe, ref)
    sets = [probe] + [make(i + 1) for i in range(sets_for(moved) - 1)]
    compiled = {"torch.compile": compile_fn(spec.reference, False), "compile+emulate": compile_fn(spec.reference, True)}
    compiled[CONTROL] = compiled["compile+emulate"]

    def call(name, args):
        if name == "eager":
            return lambda: spec.reference(*args)
        if name.startswith("bitfuse "):
            return bitfuse_call(spec, name.split()[1], args)
        return lambda: compiled[name](*args)

    def compare(name):
        with torch.no_grad():
            if name.startswith("bitfuse "):
                return check_bitfuse(spec, name.split()[1], probe, ref)
            return check(call(name, probe)(), ref)

    rows = []
    for name, r in measure(variants(spec), call, sets, compare).items():
        row = dict(op=spec.name, B=B, S=S, D=D, layout=layout, dtype=str(dtype).replace("torch.", ""), variant=name,
                   **{k: v for k, v in r.items() if k != "us"})
        if "us" in r:
            tbps = moved / (r["us"] * 1e-6) / 1e12
            row.update(us=round(r["us"], 2), tbps=round(tbps, 3), pct_ceiling=round(100 * tbps / ceiling, 1),
                       floor_us=round(moved / (ceiling * 1e12) * 1e6, 2))
        rows.append(row)
        status = f"{r['us']:8.1f} us {row['pct_ceiling']:5.1f}%  exact={r.get('exact')}" if "us" in r else \
            f"ERROR {r.get('error')}"
        print(f"  {spec.name:26s} {layout:13s} {B}x{S}x{D} {name:26s} {status}", file=sys.stderr, flush=True)
    return rows


def host_costs(specs) -> dict:
    """Microseconds of host time per call on tiny tensors (the GPU keeps up): eager,
    a bitfuse call as a site makes it (plan, gate, launch), and the launch alone."""
    out = {}
    for spec in specs:
        args = spec.make_args(cases.Case(*HOST_SHAPE, torch.bfloat16, spec.layouts[0], "randn", 0, "cuda"))
        plan = spec.plan(*args)
        row = {"eager": host_us(lambda: spec.reference(*args))}
        if plan.__class__ is not str:
            row["bitfuse"] = host_us(bitfuse_call(spec, "lossless", args))
            row["launch only"] = host_us(lambda: spec.launch["lossless"](plan))
        if spec.name == "modulate":  # the custom op's boundary, the registered path of compile and capture
            row["torch.ops.bitfuse.modulate"] = host_us(lambda: torch.ops.bitfuse.modulate(*args))
        out[spec.name] = {k: round(v, 2) for k, v in row.items()}
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "us" in r and r["variant"] != CONTROL]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(len(ops), 1, figsize=(14, 3.4 * len(ops)), squeeze=False)
    colors = {"eager": "#999999", "torch.compile": "#e377c2", "compile+emulate": "#9467bd",
              "bitfuse lossless": "#2ca02c", "bitfuse high": "#1f77b4"}
    for ax, op in zip(axes[:, 0], ops):
        sub = [r for r in rows if r["op"] == op]
        keys = list(dict.fromkeys((r["layout"], r["S"], r["D"]) for r in sub))
        names = [v for v in colors if any(r["variant"] == v for r in sub)]
        width = 0.8 / len(names)
        for i, v in enumerate(names):
            for j, key in enumerate(keys):
                r = next((r for r in sub if (r["layout"], r["S"], r["D"]) == key and r["variant"] == v), None)
                if r is None:
                    continue
                ax.bar(j + i * width, r["pct_ceiling"], width, color=colors[v], label=v if j == 0 else None,
                       hatch="" if r.get("exact") else "//", edgecolor="white")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
        ax.set_xticklabels([f"{layout}\n{S}x{D}" for layout, S, D in keys], fontsize=7)
        ax.set_ylabel("% of copy ceiling")
        ax.set_title(f"{op}: % of the copy ceiling, hatched = not bitwise equal to eager", fontsize=9)
        ax.axhline(100, color="k", lw=0.5)
        ax.legend(fontsize=7, ncol=5, loc="upper left")
        ax.set_ylim(0, 125)
    fig.suptitle(f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}, "
                 f"copy ceiling {result['copy_ceiling_tbps']:.2f} TB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SUMMARY_VARIANTS = ("eager", "torch.compile", "compile+emulate", "bitfuse lossless", "bitfuse high")


def summary_table(rows) -> str:
    """us, % of the copy ceiling and '=' (bitwise equal to eager) or 'x', a row per case."""
    lines = [f"{'op':26s} {'layout':13s} {'S':>6s} {'D':>5s} " + " ".join(f"{v:>18s}" for v in SUMMARY_VARIANTS)]
    keys = list(dict.fromkeys((r["op"], r["layout"], r["S"], r["D"]) for r in rows))
    for key in keys:
        cells = []
        for v in SUMMARY_VARIANTS:
            r = next((r for r in rows if (r["op"], r["layout"], r["S"], r["D"]) == key and r["variant"] == v), None)
            if r is None:
                cells.append("")
            elif "us" not in r:
                cells.append("error")
            else:
                cells.append(f"{r['us']:7.1f} {r['pct_ceiling']:5.1f}% {'=' if r.get('exact') else 'x'}")
        lines.append(f"{key[0]:26s} {key[1]:13s} {key[2]:6d} {key[3]:5d} " + " ".join(f"{c:>18s}" for c in cells))
    lines.append("(us, % of the copy ceiling, '=' bitwise equal to eager / 'x' not)")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.ops", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="each op's first layout only")
    size.add_argument("--sweep", action="store_true", help="also the shape sweep for the first two layouts")
    ap.add_argument("--widths", type=lambda v: [int(w) for w in v.split(",") if w], default=[],
                    help="comma-separated row widths: the first layout at each, as many elements as the main shape")
    ap.add_argument("--ops", help=f"comma-separated op names (default all: {', '.join(MEMORY_OPS)})")
    ap.add_argument("--budget", type=float, default=540,
                    help="seconds after which no new case starts (default 540: under a 10-minute limit)")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--tag", default="", help="file-name suffix")
    args = ap.parse_args(argv)
    names = [n for n in (args.ops or "").split(",") if n] or list(MEMORY_OPS)
    unknown = [n for n in names if n not in MEMORY_OPS]
    if unknown:
        ap.error(f"unknown or not memory-bound op(s) {', '.join(unknown)}; choose from {', '.join(MEMORY_OPS)}")
    args.specs = [SPECS[n] for n in names]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/ops.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    t0 = time.perf_counter()
    allow_many_recompiles()
    ceiling = copy_ceiling_tbps()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, copy ceiling {ceiling:.3f} TB/s",
          file=sys.stderr)
    host = host_costs(args.specs)
    for op, row in host.items():
        print(f"host us/call {op:26s} " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), file=sys.stderr)
    todo = plan_cases(args.specs, args.quick, args.sweep, args.widths)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"ops-{slug}{'-' + args.tag if args.tag else ''}")
    rows: list = []
    result = dict(bench="ops", gpu=gpu, capability=".".join(map(str, torch.cuda.get_device_capability())),
                  torch=torch.__version__, triton=triton.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python -m bench.ops " + " ".join(sys.argv[1:] if argv is None else argv),
                  dtype="bfloat16", copy_ceiling_tbps=round(ceiling, 3), method=__doc__.strip(), host_us=host,
                  rows=rows, skipped=[])
    for i, (spec, layout, shape) in enumerate(todo):
        if time.perf_counter() - t0 > args.budget:
            result["skipped"] = [f"{s.name} {lay} {'x'.join(map(str, sh))}" for s, lay, sh in todo[i:]]
            print(f"budget of {args.budget:.0f} s spent: {len(todo) - i} cases not run", file=sys.stderr)
            break
        rows += run_case(spec, layout, shape, ceiling)
        result["silu_forms"] = conv_epilogue.silu_forms()  # the SiLU the conv epilogues run (SILU_FORMS)
        torch.cuda.empty_cache()  # the case's operands and graphs are gone with it
        with open(stem + ".json", "w") as f:  # after every case: a run cut short keeps what it measured
            json.dump(result, f, indent=1)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    try:
        plot(result, stem + ".png")
    except Exception as exc:  # noqa: BLE001 - the JSON is written
        print(f"no plot: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"wrote {stem}.json ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    print(summary_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
