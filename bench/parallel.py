"""LTX-2 across GPUs: diffusers' context parallelism with bitfuse's plan, eager and lossless.

    python -m bench.parallel                                   # 1 GPU: the baseline
    torchrun --nproc-per-node 2 -m bench.parallel              # 2 GPUs, Ulysses
    torchrun --nproc-per-node 4 -m bench.parallel              # 4 GPUs (126 audio tokens: uneven mode)
    torchrun --nproc-per-node 2 -m bench.parallel --cp ring    # ring attention (_native_cudnn backend)
    python -m bench.parallel --report                          # the speedups from the JSON files written

Model: diffusers' LTX2VideoTransformer3DModel at full width, 48 layers (--layers),
random weights (rank 0's broadcast to every rank), bf16, batch 2 as LTX2Pipeline
runs CFG, RoPE coordinates passed as the pipeline passes them; 6,144 and 24,576
video tokens (121 frames at 512 x 768 and at 1024 x 1536), 126 audio and 256
text tokens. With N > 1 processes the model is sharded with
`bitfuse.models.ltx2_parallel.enable_context_parallel` (Ulysses by default);
where N does not divide a sequence (126 audio tokens over 4 GPUs) diffusers'
uneven mode is used and recorded.

Per size: every rank first runs eager on its own GPU, unsharded (the one-GPU
output); then context parallelism is enabled and, in --rounds interleaved rounds
(mode order rotated each round), each mode (eager = stock diffusers, lossless =
bitfuse.accelerate) is entered, run once untimed, timed over --per-round
forwards (CUDA-synchronised on every rank; a forward's time is the slowest
rank's), and undone. Checked: lossless under CP equals eager under CP bit for bit
(torch.equal), and how many output values of eager under CP differ from the
one-GPU output. Rank 0 writes bench/results/parallel-<gpu>-<N>gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from bitfuse import modes
from bitfuse.numerics import differing

SIZES = {6144: (16, 16, 24), 24576: (16, 32, 48)}  # video tokens -> latent (frames, height, width)
AUDIO, TEXT = 126, 256
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.parallel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--variant", choices=("2.0", "2.3"), default="2.0")
    ap.add_argument("--video-tokens", default="6144,24576",
                    help=f"comma-separated, from {', '.join(map(str, SIZES))}")
    ap.add_argument("--audio-tokens", type=int, default=AUDIO)
    ap.add_argument("--text-tokens", type=int, default=TEXT)
    ap.add_argument("--cp", choices=("ulysses", "ring"), default="ulysses")
    ap.add_argument("--modes", default="eager,lossless")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/parallel-<gpu>-<N>gpu[-ring].json)")
    ap.add_argument("--report", action="store_true", help="read the JSON files and print the speedups")
    args = ap.parse_args(argv)
    args.sizes = [int(t) for t in args.video_tokens.split(",") if t.strip()]
    for t in args.sizes:
        if t not in SIZES:
            ap.error(f"--video-tokens {t}: choose from {', '.join(map(str, SIZES))}")
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.mode_list:
        if m not in ("eager", "lossless", "high"):
            ap.error(f"--modes: {m!r} does not run with context parallelism (eager, lossless, high)")
    if "eager" not in args.mode_list:
        args.mode_list.insert(0, "eager")
    return args


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, file=sys.stderr, flush=True)


def _max_over_ranks(value: float, distributed: bool) -> float:
    if not distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def timed_forwards(model, kwargs, n: int, distributed: bool) -> tuple[list[float], tuple]:
    """n synchronised forwards; ms of each (the slowest rank's), and the last output."""
    times = []
    out = None
    for _ in range(n):
        torch.cuda.synchronize()
        if distributed:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        out = model(**kwargs)
        torch.cuda.synchronize()
        times.append(_max_over_ranks((time.perf_counter() - t0) * 1e3, distributed))
    return times, out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        return report()
    from diffusers.models._modeling_parallel import ContextParallelConfig

    from bitfuse.models import ltx2_parallel
    from bitfuse.models.ltx2_configs import build_model, full_config, make_inputs

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    distributed = world > 1
    if not torch.cuda.is_available():
        sys.exit("bench.parallel needs CUDA GPUs")
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    if distributed:
        torch.distributed.init_process_group("nccl", device_id=device)
    model = build_model(full_config(args.layers, args.variant), device=device, dtype=torch.bfloat16, seed=0)
    if distributed:  # the same weights on every rank, whatever each GPU's random stream did
        for p in list(model.parameters()) + list(model.buffers()):
            torch.distributed.broadcast(p.data, 0)
    backend = "_native_cudnn" if args.cp == "ring" else "native"
    if backend != "native":
        model.set_attention_backend(backend)
    common = {"audio_tokens": args.audio_tokens, "text_tokens": args.text_tokens, "pass_coords": True,
                  "use_cross_timestep": args.variant == "2.3", "seed": 0}
    inputs = {t: make_inputs(model, args.batch, video_tokens_shape=SIZES[t], **common) for t in args.sizes}

    # the one-GPU output of each size (eager, unsharded), and its time on one GPU
    one_gpu = {}
    for t, kw in inputs.items():
        with torch.no_grad():
            model(**kw)
            ms, out = timed_forwards(model, kw, 1, False)
        one_gpu[t] = (ms[0], [o.detach() for o in out])
        log(f"{t} video tokens, one GPU eager: {ms[0]:.1f} ms")

    cp_config = None
    if distributed:
        n = world
        anything = any(s % n for s in (*args.sizes, args.audio_tokens, args.text_tokens))
        key = args.cp
        cp_config = ContextParallelConfig(**{f"{key}_degree": n, f"{key}_anything": anything})
        ltx2_parallel.enable_context_parallel(model, cp_config)
        log(f"context parallelism: {args.cp} x{n}" + (" (uneven mode)" if anything else ""))

    results = []
    for t, kw in inputs.items():
        samples = {m: [] for m in args.mode_list}
        outputs = {}
        for r in range(args.rounds):
            order = args.mode_list[r % len(args.mode_list):] + args.mode_list[:r % len(args.mode_list)]
            for mode in order:
                with torch.no_grad(), modes.entered(mode, model):
                    model(**kw)  # untimed: first sight, JIT
                    ms, out = timed_forwards(model, kw, args.per_round, distributed)
                samples[mode] += ms
                outputs[mode] = [o.detach() for o in out]
        eager = outputs["eager"]
        row = {"video_tokens": t, "audio_tokens": args.audio_tokens, "text_tokens": args.text_tokens,
                   "one_gpu_eager_ms": one_gpu[t][0],
                   "eager_differs_from_one_gpu": {k: differing(a, b) for k, a, b in
                                               zip(("video", "audio"), eager, one_gpu[t][1])},
                   "values": {k: a.numel() for k, a in zip(("video", "audio"), eager)}}
        for mode in args.mode_list:
            row[f"{mode}_ms"] = statistics.median(samples[mode])
            row[f"{mode}_samples_ms"] = samples[mode]
            if mode != "eager":
                row[f"{mode}_equals_eager"] = all(torch.equal(a, b) for a, b in zip(outputs[mode], eager))
                row[f"{mode}_differs_from_eager"] = {k: differing(a, b) for k, a, b in
                                                     zip(("video", "audio"), outputs[mode], eager)}
        results.append(row)
        log(f"{t} video tokens on {world} GPU(s): " + ", ".join(
            f"{m} {row[f'{m}_ms']:.1f} ms" for m in args.mode_list)
            + "".join(f"; {m} {'==' if row[f'{m}_equals_eager'] else '!='} eager" for m in args.mode_list[1:])
            + f"; eager differs from one GPU in {row['eager_differs_from_one_gpu']}")

    if rank == 0:
        import diffusers

        gpu = torch.cuda.get_device_name(device)
        suffix = "-ring" if distributed and args.cp == "ring" else ""
        out = args.out or os.path.join(RESULTS, f"parallel-{slug(gpu)}-{world}gpu{suffix}.json")
        doc = {"gpu": gpu, "gpus": world, "layers": args.layers, "batch": args.batch, "variant": args.variant, "dtype": "bf16",
                   "context_parallel": None if not distributed else {
                       "kind": args.cp, "degree": world, "uneven": bool(cp_config.ulysses_anything or cp_config.ring_anything),
                       "attention_backend": backend},
                   "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                                 "nccl": ".".join(map(str, torch.cuda.nccl.version())) if distributed else None},
                   "rounds": args.rounds, "per_round": args.per_round, "results": results}
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(doc, f, indent=2)
        log(f"wrote {out}")
    if distributed:
        torch.distributed.destroy_process_group()
    broken = [r["video_tokens"] for r in results for m in args.mode_list[1:]
              if m == "lossless" and not r[f"{m}_equals_eager"]]
    return 1 if broken else 0


def report(results_dir: str = RESULTS) -> int:
    """The speedups of N GPUs over one, per size and mode, from the JSON files."""
    runs = {}
    for name in sorted(os.listdir(results_dir)):
        if name.startswith("parallel-") and name.endswith(".json") and "gpu" in name:
            with open(os.path.join(results_dir, name)) as f:
                doc = json.load(f)
            if "results" in doc:
                runs[name] = doc
    if not runs:
        print("no bench/results/parallel-*.json yet", file=sys.stderr)
        return 1
    base = {(d["gpu"], r["video_tokens"]): r for d in runs.values() if d["gpus"] == 1 for r in d["results"]}
    lines = ["file                                  tokens  mode      ms       x one GPU  == eager  differs from 1 GPU"]
    for name, d in runs.items():
        for r in d["results"]:
            b = base.get((d["gpu"], r["video_tokens"]))
            for mode in ("eager", "lossless", "high"):
                if f"{mode}_ms" not in r:
                    continue
                speed = f"{b[f'{mode}_ms'] / r[f'{mode}_ms']:.2f}x" if b and f"{mode}_ms" in b else "-"
                same = "-" if mode == "eager" else str(r[f"{mode}_equals_eager"])
                diff = r["eager_differs_from_one_gpu"] if mode == "eager" else ""
                lines.append(f"{name[:36]:36}  {r['video_tokens']:6}  {mode:8}  {r[f'{mode}_ms']:8.1f}  "
                             f"{speed:>9}  {same:8}  {diff}")
    print("\n".join(lines))
    print("target: 2 GPUs >= 1.7x one GPU at 24,576 video tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
