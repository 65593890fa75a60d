"""Op benchmark: eager, torch.compile, compile + emulate_precision_casts and bitfuse,
timed in one run on one GPU, with the copy ceiling measured in the same run.

    python3 bench/ops.py [--quick] [--out bench/results]

Each variant: median device microseconds per call (bench/timing.py: warm-up
first, CUDA-graph replay over input sets several times the L2), achieved TB/s
over the bytes the op must move (each input read once, the output written
once), that as a percentage of the copy ceiling measured the same way, and
whether its output is `torch.equal` to eager's. bitfuse is called through its
sites, as a model calls them. Host cost per call (guard, gate, launch) is
measured separately on tiny tensors. Every variant is captured three times
(separate output buffers: where a buffer lies moves a time by up to 0.4%) and
the captures are pooled. Each row also keeps its median per interleaved round
(`rounds_us`), so two variants can be compared round by round (bench/report.py
does, for bitfuse against compile + emulate); a second, independent copy of
compile + emulate ("compile+emulate (control)") shows how far two timings of
the same code differ. Writes ops-<gpu>.json and a PNG.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from timing import GraphTimer, copy_ceiling_tbps, host_us, interleaved_samples, pooled_rounds, sets_for  # noqa: E402

import bitfuse.ops.modulate  # noqa: E402,F401
import bitfuse.ops.rotary  # noqa: E402,F401
from bitfuse import quality, sites  # noqa: E402
from bitfuse.numerics import max_ulp  # noqa: E402


def compiled(fn, emulate):
    """torch.compile of `fn`; with `emulate`, Inductor keeps eager's intermediate roundings.
    Each call makes its own backend, so the two variants never share a cache entry."""
    return torch.compile(fn, dynamic=False, options={"emulate_precision_casts": emulate})


def allow_many_recompiles():
    """Every shape and variant compiles the same few functions: lift Dynamo's
    per-function cache limit so none silently falls back to eager."""
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 4096)


def modulate_eager(x, c, h):
    return x * (1 + c) + h


def gated_eager(x, y, g):
    return x + y * g


def rms_diffusers(x, eps=1e-6):
    v = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(v + eps)).to(x.dtype)


def rms_aten(x, eps=1e-6):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)


def layer_norm(x, eps=1e-6):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps)


class DiffusersRMSNorm(torch.nn.Module):
    """diffusers' RMSNorm without weight, as the LTX-2 blocks hold it (no diffusers needed)."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return rms_diffusers(x, self.eps)


DiffusersRMSNorm.__module__ = "diffusers.models.normalization"  # what sites.norm_kind recognises
DiffusersRMSNorm.__name__ = "RMSNorm"


def operands(B, S, D, per_token, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, S, D, device="cuda", dtype=dtype, generator=g)
    y = torch.randn(B, S, D, device="cuda", dtype=dtype, generator=g)
    T = S if per_token else 1
    # the parameter views diffusers makes: (table + temb.reshape(B, T, n, D)).unbind(2)
    c, h, gate = (torch.randn(B, T, 6, D, device="cuda", dtype=dtype, generator=g) * 0.3).unbind(2)[:3]
    return x, y, c, h, gate


def make_call(op, variant, bufs, norm_refs, compiled_fns):
    """A closure running `variant` of `op` on one input set."""
    x, y, c, h, gate = bufs
    if op == "modulate":
        args = (x, c, h)
        site = lambda: sites.modulate_site(x, c, h)  # noqa: E731
    elif op == "gated_residual":
        args = (x, y, gate)
        site = lambda: sites.gated_residual_site(x, y, gate)  # noqa: E731
    else:
        norm_fn, norm_mod = norm_refs[op]
        args = (x, c, h)
        norm_site = sites.layer_norm_modulate_site if op == "layer_norm+modulate" else sites.rms_norm_modulate_site
        site = lambda: norm_site(None, norm_mod, x, c, h)  # noqa: E731
    if variant == "eager":
        return lambda: compiled_fns["eager"](*args)
    if variant in ("torch.compile", "compile+emulate"):
        return lambda: compiled_fns[variant](*args)
    if variant == CONTROL:
        return lambda: compiled_fns["compile+emulate"](*args)
    if variant == "bitfuse high":
        def high():
            with quality("high"):
                return site()
        return high
    return site


CONTROL = "compile+emulate (control)"  # the same compiled function, captured separately
INSTANCES = 3  # captures per variant, pooled
ROUNDS = 8


def measure(variants, call, sets, compare):
    """Check each variant on the first input set (`compare(output)` -> dict), capture
    INSTANCES timers of it over all sets (variants in turn, so no variant's buffers
    are all allocated first), then time all of them in interleaved rounds. Returns
    {variant: dict with "us", "rounds_us" and the comparison, or "error"}."""
    results, timers = {}, {}
    for name in variants:
        try:
            with torch.no_grad():
                out = call(name, sets[0])()
                torch.cuda.synchronize()
                results[name] = compare(out)
                del out
        except Exception as exc:  # record and go on: one broken variant must not hide the rest
            results[name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
    for i in range(INSTANCES):
        for name in variants:
            if "error" in results[name]:
                continue
            try:
                with torch.no_grad():
                    timers[(name, i)] = GraphTimer([call(name, bufs) for bufs in sets])
            except Exception as exc:
                results[name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
    for k in [k for k in timers if "error" in results[k[0]]]:
        timers.pop(k).close()
    for name, per_round in pooled_rounds(interleaved_samples(timers, rounds=ROUNDS, replays=3)).items():
        results[name]["us"] = statistics.median(v for r in per_round for v in r)
        results[name]["rounds_us"] = [round(statistics.median(r), 3) for r in per_round]
    for t in timers.values():
        t.close()
    return results


def record(row, r, moved, ceiling):
    """One result row: the case, then time, bandwidth and exactness (or the error)."""
    if "error" in r:
        print(f"  {row['op']} D={row['D']} S={row['S']} {row['params']} {row['variant']}: ERROR {r['error']}")
        return {**row, "error": r["error"]}
    t = r["us"]
    tbps = moved / (t * 1e-6) / 1e12
    row.update(us=round(t, 2), tbps=round(tbps, 3), pct_ceiling=round(100 * tbps / ceiling, 1),
               floor_us=round(moved / (ceiling * 1e12) * 1e6, 2), exact=r["exact"], max_ulp=r["max_ulp"],
               mismatches=r["mismatches"], rounds_us=r["rounds_us"])
    print(f"  {row['op']:28s} D={row['D']:5d} S={row['S']:6d} {row['params']:11s} {row['variant']:18s} "
          f"{t:8.1f} us {row['pct_ceiling']:5.1f}% exact={row['exact']}")
    return row


def run_case(op, B, S, D, per_token, ceiling, rows, norm_refs):
    probe = operands(B, S, D, per_token)
    e = probe[0].element_size()
    full = probe[0].numel() * e
    param = full if per_token else B * D * e
    moved = {"modulate": 2 * full + 2 * param, "gated_residual": 3 * full + param}.get(op, 2 * full + 2 * param)
    if op == "modulate":
        eager = modulate_eager
    elif op == "gated_residual":
        eager = gated_eager
    else:
        norm_fn = norm_refs[op][0]

        def eager(x, c, h, norm_fn=norm_fn):
            return norm_fn(x) * (1 + c) + h

    variants = ["eager", "torch.compile", "compile+emulate", "bitfuse lossless"]
    if op in ("modulate", "gated_residual"):
        variants.append(CONTROL)
    else:
        variants.append("bitfuse high")
        norm_refs = {k: (fn, make(D)) for k, (fn, make) in norm_refs.items()}
    compiled_fns = {"eager": eager, "torch.compile": compiled(eager, False), "compile+emulate": compiled(eager, True)}
    n_sets = sets_for(moved)
    sets = [probe] + [operands(B, S, D, per_token, seed=i + 1) for i in range(n_sets - 1)]
    ref = make_call(op, "eager", probe, norm_refs, compiled_fns)()
    params = "per-token" if per_token else "per-sample"
    call = lambda name, bufs: make_call(op, name, bufs, norm_refs, compiled_fns)  # noqa: E731

    def compare(out):
        return dict(exact=bool(torch.equal(out, ref)), max_ulp=max_ulp(out, ref), mismatches=int((out != ref).sum()))

    for name, r in measure(variants, call, sets, compare).items():
        rows.append(record(dict(op=op, B=B, S=S, D=D, params=params, variant=name), r, moved, ceiling))
    del sets, probe
    torch.cuda.empty_cache()


def rotary_operands(rope_type, B, S, D, seed=0):
    """Query, key and fp32 cos/sin as diffusers' LTX-2 builds them (split: the swapaxes view)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    if rope_type == "interleaved":
        theta = torch.rand(B, S, D // 2, device="cuda", generator=g).repeat_interleave(2, -1) * 40 - 20
        return q, k, (theta.cos(), theta.sin())
    theta = torch.rand(B, S, D // 128, 64, device="cuda", generator=g) * 40 - 20
    return q, k, (theta.cos().swapaxes(1, 2), theta.sin().swapaxes(1, 2))


def run_rotary_case(rope_type, B, S, D, ceiling, rows):
    """RoPE of a query and a key sharing frequencies (self-attention), as the processor applies it."""
    reference = sys.modules["bitfuse.ops.rotary"].rotary_reference

    def eager(q, k, cos, sin):
        return reference(q, (cos, sin), rope_type), reference(k, (cos, sin), rope_type)

    probe = rotary_operands(rope_type, B, S, D)
    q, k, (cos, sin) = probe
    moved = 4 * q.numel() * q.element_size() + 2 * cos.numel() * 4
    fns = {"eager": eager, "torch.compile": compiled(eager, False), "compile+emulate": compiled(eager, True)}

    def call(name, bufs):
        q, k, freqs = bufs
        if name == "bitfuse lossless":
            return lambda: sites.rotary_site(q, k, freqs, None, rope_type)
        return lambda: fns[name](q, k, *freqs)

    n_sets = sets_for(moved)
    sets = [probe] + [rotary_operands(rope_type, B, S, D, seed=i + 1) for i in range(n_sets - 1)]
    ref = call("eager", probe)()

    def compare(out):
        return dict(exact=all(bool(torch.equal(o, r)) for o, r in zip(out, ref)),
                    max_ulp=max(max_ulp(o, r) for o, r in zip(out, ref)),
                    mismatches=sum(int((o != r).sum()) for o, r in zip(out, ref)))

    names = ("eager", "torch.compile", "compile+emulate", "bitfuse lossless")
    for name, r in measure(names, call, sets, compare).items():
        rows.append(record(dict(op="rotary q+k", B=B, S=S, D=D, params=rope_type, variant=name), r, moved, ceiling))
    del sets, probe
    torch.cuda.empty_cache()


def host_costs():
    """Microseconds of host time per call on tiny tensors (the GPU keeps up)."""
    x, y, c, h, gate = operands(1, 8, 64, False)
    sys_mod = sys.modules["bitfuse.ops.modulate"]
    plan = sys_mod.plan_modulate(x, c, h)
    recipe, out = plan.recipe, torch.empty_like(x)

    def triton_launch():  # the same kernel through Triton's own launch path (the 15.5 us anchor)
        sys_mod._modulate_kernel[recipe.grid](x, c, h, out, c, h, *recipe.ints,
                                              **dict(zip(sys_mod._launch.names, recipe.consts)),
                                              num_warps=recipe.num_warps, enable_fp_fusion=False)

    triton_launch()
    return {
        "eager x*(1+scale)+shift (3 ops)": host_us(lambda: x * (1 + c) + h),
        "eager x+y*gate (2 ops)": host_us(lambda: x + y * gate),
        "bitfuse modulate_site": host_us(lambda: sites.modulate_site(x, c, h)),
        "bitfuse gated_residual_site": host_us(lambda: sites.gated_residual_site(x, y, gate)),
        "bitfuse launch only (planned)": host_us(lambda: sys_mod.launch_modulate(plan)),
        "raw Triton launch of the same kernel": host_us(triton_launch),
        "torch.ops.bitfuse.modulate (torch.library)": host_us(lambda: torch.ops.bitfuse.modulate(x, c, h)),
    }


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "us" in r]
    ops = sorted({r["op"] for r in rows}, key=lambda o: [r["op"] for r in rows].index(o))
    fig, axes = plt.subplots(len(ops), 1, figsize=(14, 3.6 * len(ops)), squeeze=False)
    colors = {"eager": "#999999", "torch.compile": "#e377c2", "compile+emulate": "#9467bd",
              "bitfuse lossless": "#2ca02c", "bitfuse high": "#1f77b4"}
    for ax, op in zip(axes[:, 0], ops):
        sub = [r for r in rows if r["op"] == op]
        cases = sorted({(r["D"], r["S"], r["params"]) for r in sub})
        names = [v for v in colors if any(r["variant"] == v for r in sub)]
        width = 0.8 / len(names)
        for i, v in enumerate(names):
            for j, case in enumerate(cases):
                r = next((r for r in sub if (r["D"], r["S"], r["params"]) == case and r["variant"] == v), None)
                if r is None:
                    continue
                bar = ax.bar(j + i * width, r["pct_ceiling"], width, color=colors[v], label=v if j == 0 else None,
                             hatch="" if r["exact"] else "//", edgecolor="white")
                ax.text(bar[0].get_x() + width / 2, r["pct_ceiling"] + 1, f"{r['us']:.0f}", ha="center",
                        fontsize=6, rotation=90)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels([f"D={d}\nS={s}\n{p}" for d, s, p in cases], fontsize=7)
        ax.set_ylabel("% of copy ceiling")
        ax.set_title(f"{op} ({result['dtype']}): bar = % of copy ceiling, label = us, hatched = not bit-exact")
        ax.axhline(100, color="k", lw=0.5)
        ax.legend(fontsize=7, ncol=5, loc="upper left")
        ax.set_ylim(0, 125)
    fig.suptitle(f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}, "
                 f"copy ceiling {result['copy_ceiling_tbps']:.2f} TB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--quick", action="store_true", help="one shape per op")
    ap.add_argument("--skip", default="", help="comma-separated ops to leave out")
    ap.add_argument("--norm-shapes", choices=("all", "main"), default="all",
                    help="norm + modulate at D in {2048, 3072, 4096, 5120} x 6144 and 4096 x 24576, "
                         "or at 4096 x 6144 only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/ops.py needs a CUDA GPU")
    allow_many_recompiles()
    ceiling = copy_ceiling_tbps()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, copy ceiling {ceiling:.3f} TB/s")
    host = host_costs()
    for k, v in host.items():
        print(f"host {k:45s} {v:6.1f} us/call")
    rows = []
    skip = set(filter(None, args.skip.split(",")))
    pointwise = [(D, S) for D in (4096, 2048) for S in (1024, 6144, 24576)]
    norm_shapes = [(D, 6144) for D in (2048, 3072, 4096, 5120)] + [(4096, 24576)]
    if args.norm_shapes == "main":
        norm_shapes = [(4096, 6144)]
    if args.quick:
        pointwise, norm_shapes = [(4096, 6144)], [(4096, 6144)]
    norm_refs = {
        "rms_norm[diffusers]+modulate": (rms_diffusers, lambda D: DiffusersRMSNorm()),
        "rms_norm[aten]+modulate": (rms_aten, lambda D: torch.nn.RMSNorm(D, eps=1e-6, elementwise_affine=False)),
        "layer_norm+modulate": (layer_norm, lambda D: torch.nn.LayerNorm(D, eps=1e-6, elementwise_affine=False)),
    }
    import importlib.metadata as md

    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"ops-{slug}.json")
    result = dict(gpu=gpu, capability=".".join(map(str, torch.cuda.get_device_capability())),
                  torch=torch.__version__, triton=triton.__version__,
                  bitfuse=md.version("bitfuse") if _installed("bitfuse") else "source",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  dtype="bfloat16", copy_ceiling_tbps=round(ceiling, 3), method=__doc__.strip(),
                  host_us={k: round(v, 2) for k, v in host.items()}, rows=rows)
    cases = [(op, D, S) for op in ("modulate", "gated_residual") if op not in skip for D, S in pointwise]
    cases += [(op, D, S) for op in norm_refs if op not in skip for D, S in norm_shapes]
    for op, D, S in cases:
        for per_token in (False, True):
            run_case(op, 1, S, D, per_token, ceiling, rows, norm_refs)
        with open(path, "w") as f:  # after every case: a cut-short run keeps what it measured
            json.dump(result, f, indent=1)
    if "rotary" not in skip:
        for rope_type in ("interleaved", "split"):
            for D in ((4096,) if args.quick else (4096, 2048)):
                run_rotary_case(rope_type, 1, 6144, D, ceiling, rows)
                with open(path, "w") as f:
                    json.dump(result, f, indent=1)
    try:
        plot(result, os.path.join(args.out, f"ops-{slug}.png"))
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"wrote {path}")
    print_summary(result)


def _installed(name):
    import importlib.metadata as md

    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


def print_summary(result):
    rows = [r for r in result["rows"] if "us" in r]
    print(f"\n{'op':28s} {'D':>5s} {'S':>6s} {'params':10s} " + " ".join(
        f"{v:>18s}" for v in ("eager", "torch.compile", "compile+emulate", "bitfuse lossless", "bitfuse high")))
    cases = []
    for r in rows:
        k = (r["op"], r["D"], r["S"], r["params"])
        if k not in cases:
            cases.append(k)
    for k in cases:
        cells = []
        for v in ("eager", "torch.compile", "compile+emulate", "bitfuse lossless", "bitfuse high"):
            r = next((r for r in rows if (r["op"], r["D"], r["S"], r["params"]) == k and r["variant"] == v), None)
            cells.append(f"{r['us']:7.1f} {r['pct_ceiling']:5.1f}% {'=' if r['exact'] else 'x'}" if r else " " * 16)
        print(f"{k[0]:28s} {k[1]:5d} {k[2]:6d} {k[3]:10s} " + " ".join(f"{c:>18s}" for c in cells))
    print("(us, % of copy ceiling, '=' bit-exact with eager / 'x' not)")


if __name__ == "__main__":
    main()
