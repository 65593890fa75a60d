"""Op benchmark: eager, torch.compile, compile + emulate_precision_casts and bitfuse,
timed in one run on one GPU, with the copy ceiling measured in the same run.

    python3 bench/ops.py [--quick] [--out bench/results]

Each variant: median microseconds (triton.testing.do_bench: warm-up first,
L2 flushed before every run), achieved TB/s over the bytes the op must move
(each input read once, the output written once), that as a percentage of the
measured device-to-device copy ceiling, and whether its output is
`torch.equal` to eager's. bitfuse is timed through its sites, as a model
calls them (guard, gate and launch included). Writes ops-<gpu>.json and a PNG.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from bitfuse import quality, sites  # noqa: E402
from bitfuse.numerics import max_ulp  # noqa: E402


def us(fn, rep=100):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


def copy_ceiling_tbps():
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = us(lambda: dst.copy_(src), rep=300)
    return 2 * src.numel() * src.element_size() / (t * 1e-6) / 1e12


def compiled(fn, emulate):
    """torch.compile of `fn`; with `emulate`, Inductor keeps eager's intermediate roundings."""
    c = torch.compile(fn, dynamic=False)

    def call(*args):
        with torch._inductor.config.patch(emulate_precision_casts=emulate):
            return c(*args)

    return call


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


def run_case(op, B, S, D, per_token, ceiling, rows, norm_refs):
    x, y, c, h, gate = operands(B, S, D, per_token)
    e = x.element_size()
    full = x.numel() * e
    param = full if per_token else B * D * e
    if op == "modulate":
        args, eager, moved = (x, c, h), modulate_eager, 2 * full + 2 * param
        variants = {"bitfuse lossless": lambda: sites.modulate_site(x, c, h)}
    elif op == "gated_residual":
        args, eager, moved = (x, y, gate), gated_eager, 3 * full + param
        variants = {"bitfuse lossless": lambda: sites.gated_residual_site(x, y, gate)}
    else:
        norm_fn, make_norm = norm_refs[op]
        norm_mod = make_norm(D)
        args, moved = (x, c, h), 2 * full + 2 * param

        def eager(x, c, h, norm_fn=norm_fn):
            return norm_fn(x) * (1 + c) + h

        site = sites.layer_norm_modulate_site if op == "layer_norm+modulate" else sites.rms_norm_modulate_site

        def lossless():
            return site(None, norm_mod, x, c, h)

        def high():
            with quality("high"):
                return site(None, norm_mod, x, c, h)

        variants = {"bitfuse lossless": lossless, "bitfuse high": high}
    ref = eager(*args)
    all_variants = {
        "eager": lambda: eager(*args),
        "torch.compile": (lambda f: lambda: f(*args))(compiled(eager, False)),
        "compile+emulate": (lambda f: lambda: f(*args))(compiled(eager, True)),
        **variants,
    }
    floor = moved / (ceiling * 1e12) * 1e6
    for name, fn in all_variants.items():
        try:
            with torch.no_grad():
                out = fn()
                torch.cuda.synchronize()
                exact = bool(torch.equal(out, ref))
                ulps = max_ulp(out, ref)
                t = us(fn)
        except Exception as exc:  # record and go on: one broken variant must not hide the rest
            rows.append(dict(op=op, B=B, S=S, D=D, params="per-token" if per_token else "per-sample",
                             variant=name, error=f"{type(exc).__name__}: {exc}"[:300]))
            print(f"  {name}: ERROR {exc}")
            continue
        tbps = moved / (t * 1e-6) / 1e12
        row = dict(op=op, B=B, S=S, D=D, params="per-token" if per_token else "per-sample", variant=name,
                   us=round(t, 2), tbps=round(tbps, 3), pct_ceiling=round(100 * tbps / ceiling, 1),
                   floor_us=round(floor, 2), exact=exact, max_ulp=ulps,
                   mismatches=int((out != ref).sum()))
        rows.append(row)
        print(f"  {op:22s} D={D:5d} S={S:6d} {row['params']:10s} {name:18s} {t:8.1f} us "
              f"{row['pct_ceiling']:5.1f}% exact={exact}")


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
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/ops.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    ceiling = copy_ceiling_tbps()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, copy ceiling {ceiling:.3f} TB/s")
    rows = []
    skip = set(filter(None, args.skip.split(",")))
    pointwise = [(D, S) for D in (4096, 2048) for S in (1024, 6144, 24576)]
    norm_shapes = [(D, 6144) for D in (2048, 3072, 4096, 5120)] + [(4096, 24576)]
    if args.quick:
        pointwise, norm_shapes = [(4096, 6144)], [(4096, 6144)]
    norm_refs = {
        "rms_norm[diffusers]+modulate": (rms_diffusers, lambda D: DiffusersRMSNorm()),
        "rms_norm[aten]+modulate": (rms_aten, lambda D: torch.nn.RMSNorm(D, eps=1e-6, elementwise_affine=False)),
        "layer_norm+modulate": (layer_norm, lambda D: torch.nn.LayerNorm(D, eps=1e-6, elementwise_affine=False)),
    }
    for op in ("modulate", "gated_residual"):
        if op in skip:
            continue
        for D, S in pointwise:
            for per_token in (False, True):
                run_case(op, 1, S, D, per_token, ceiling, rows, norm_refs)
    for op in norm_refs:
        if op in skip:
            continue
        for D, S in norm_shapes:
            for per_token in (False, True):
                run_case(op, 1, S, D, per_token, ceiling, rows, norm_refs)
    import importlib.metadata as md

    result = dict(gpu=gpu, capability=".".join(map(str, torch.cuda.get_device_capability())),
                  torch=torch.__version__, triton=triton.__version__,
                  bitfuse=md.version("bitfuse") if _installed("bitfuse") else "source",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  dtype="bfloat16", copy_ceiling_tbps=round(ceiling, 3), method=__doc__.strip(), rows=rows)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"ops-{slug}.json")
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
