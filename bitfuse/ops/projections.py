"""Projections of one input as one GEMM: `F.linear(x, w_i, b_i)` for i = 1..n (an
attention's q, k, v from the same tokens, or its k, v from the caption) computed as
`F.linear(x, W, b)` on the weights laid end to end, the outputs its column slices.

Why. A host-bound model (Sana at 1024 x 1024: every block's aten calls cost more host
time than their kernels take on the GPU) pays each GEMM's host work (cuBLAS's heuristic
query, the launch; about 17 µs a call on the H200 hosts measured) once per
projection. One GEMM for the three self-attention projections costs one call's host
work (18 against 51 µs measured, bench/NOTES.md); for the caption's k and v (600 rows)
it also halves the GPU time (25 against 51 µs: two small GEMMs each leave most of the
GPU idle in their last wave).

Why it keeps every bit. Each output element is a dot product over the same K inputs in
the same order whichever N the GEMM has, unless cuBLAS picks an algorithm that splits
K (split-K, stream-K) for one problem and not the other; the bias is added to the
fp32 accumulator and rounded once either way. That holds for the shapes measured
(Sana, FLUX, Wan, LTX-2, bf16 on the H200: every output bitwise equal) and is not
promised for any other, so the gate verifies each problem (dtype, device, M, K, the
parts' rows and offsets, x's shape, strides and alignment, the weight's and the
bias's alignment) at first sight against the separate calls, as for every kernel, and
a mismatch keeps the separate calls for good. The call's own data is not enough for
that check (two GEMMs that sum K in other orders agree on most 16-bit elements of a
draw: the fuzz found problems at K = 100 that passed on one draw and differed in 1-5
elements of the next), so the gate also runs `reduction_probe` (the spec's `probe`):
the same problem on operands built so that any other order of the K sums shows in
most outputs.

The packed weight. `pack(weights, biases)` moves the weights into one buffer, each
weight's `.data` a view of its rows, and the biases into another at the same rows
(the same Parameter objects, values and shapes: no copy is kept, so nothing can go
stale, and in-place updates, `load_state_dict` or a LoRA merge write into the buffer
itself). A GEMM's algorithm choice reads its operands' pointer alignment (aten hands
cuBLASLt the alignment of x, the weight, the output and the bias, up to 256 bytes),
so every part starts 256-byte aligned, as a parameter allocated on its own does:
where N_i rows would leave the next part off alignment (Sana's 2240-element bf16
biases: 4480 bytes), zero rows pad the gap, and the one GEMM computes those columns
too (Sana's caption k, v: 64 of 4,544) and drops them. Every parameter keeps the
alignment it had, so the stock calls keep their bits. `unpack` gives each parameter
its own storage again. The planner reads the packing from the pointers on every call
(`layout`): moving the model (`.to()` copies each parameter on its own) or replacing a
parameter unpacks it, and the calls are then the separate ones. (As after `.to()`, a
tensor taken from a weight's `.data` before packing no longer aliases the weight.)
Tensor subclasses (DTensor, quantised weights) are neither packed nor planned.

Shapes: x [..., K] (any leading dims, the last contiguous); weights [N_i, K], one
dtype (x's) and device; biases all None or [N_i] each. Returns a tuple of [..., N_i]
views of one [..., R] output (R: the rows the packed parts span), where the separate
calls return contiguous tensors: consumers that read strides (the Sana kernels, SDPA) are
checked on them (tests/gpu). Exact in every tier; CUDA only (a CPU GEMM's blocking
follows N), but for the interpreter tests' switch (`_params.INTERPRET_ON_CPU`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _params, cases
from ._settings import gemm_settings
from .spec import OpSpec

ALIGN = 256  # bytes: the largest alignment aten hands cuBLASLt (and what an allocation of its own gets)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # the classes whose pointers the packing reads


class ProjectionsPlan:
    """x, the packed weight [R, K] and bias [R] (or None), each part's rows (`sizes`)
    and first row (`offsets`) in them, and the gate's key."""

    __slots__ = ("x", "weight", "bias", "sizes", "offsets", "key")

    def __init__(self, x, weight, bias, sizes, offsets, key):
        self.x, self.weight, self.bias, self.sizes, self.offsets, self.key = x, weight, bias, sizes, offsets, key


def layout(tensors) -> tuple | None:
    """Where the tensors (all 2-D [N_i, K] or all 1-D [N_i], contiguous, one dtype) lie
    in the first one's storage, if they lie as `pack` puts them: each part's first row,
    counted from the first part's, in increasing order without overlap (gaps allowed),
    the last row inside that storage. Returns (offsets, rows spanned) or None. Reads
    pointers and shapes only."""
    first = tensors[0]
    two_d = first.dim() == 2
    row_bytes = (first.shape[1] if two_d else 1) * first.element_size()
    ptr = first.data_ptr()
    offsets = []
    end = 0
    for t in tensors:
        if t.dtype != first.dtype or not t.is_contiguous() or (t.shape[1:] != first.shape[1:] if two_d else t.dim() != 1):
            return None
        step, rem = divmod(t.data_ptr() - ptr, row_bytes)
        if rem or step < end:
            return None
        offsets.append(step)
        end = step + t.shape[0]
    storage = first.untyped_storage()
    if ptr + end * row_bytes > storage.data_ptr() + storage.nbytes():  # (allocations can lie side by side)
        return None
    return tuple(offsets), end


def _span(first, rows):
    """The [rows, K] (or [rows]) view from `first`'s start."""
    if first.dim() == 2:
        return first.as_strided((rows, first.shape[1]), (first.shape[1], 1), first.storage_offset())
    return first.as_strided((rows,), (1,), first.storage_offset())


def packed(tensors) -> torch.Tensor | None:
    """The tensors as one [R, ...] view over the rows they span where they lie packed
    (`layout`), else None."""
    where = layout(tensors)
    return None if where is None else _span(tensors[0], where[1])


def packable(weights, biases) -> str | None:
    """Why `pack(weights, biases)` would not pack them, or None. weights: [N_i, K];
    biases: [N_i] each, or all None."""
    if len(weights) < 2 or len(biases) != len(weights):
        return "fewer than two weights, or not a bias (or None) for each"
    first = weights[0]
    if not all(isinstance(w, torch.Tensor) and w.dim() == 2 for w in weights):
        return "weights must be 2-D tensors"
    if any(type(p) not in _PLAIN for p in (*weights, *biases) if p is not None):
        return "a tensor subclass (DTensor, a quantised weight): its storage is not one buffer of its values"
    if any(p.is_inference() for p in (*weights, *biases) if p is not None):
        return ("inference tensors (made under torch.inference_mode()): a parameter's data can't move into a "
                "buffer of normal tensors")
    if any(w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device or w.is_meta
           for w in weights):
        return "weights of different widths, dtypes or devices (or meta)"
    if any(b is not None for b in biases) and any(
            not isinstance(b, torch.Tensor) or b.shape != (w.shape[0],) or b.dtype != first.dtype
            or b.device != first.device for b, w in zip(biases, weights)):
        return "biases must all be None, or [N_i] each in the weights' dtype and device"
    return None


def _granule(K: int, elem: int, bias: bool) -> int:
    """The fewest rows a part may be padded to so that the next part starts 256-byte
    aligned in the weight buffer (and the bias buffer)."""
    rows = ALIGN // math.gcd(ALIGN, K * elem)
    if bias:
        rows = math.lcm(rows, ALIGN // math.gcd(ALIGN, elem))
    return rows


def _aligned_zeros(shape, dtype, device) -> torch.Tensor:
    """Zeros of `shape` starting 256-byte aligned (a CUDA allocation is; a CPU one may
    not be: the interpreter tests)."""
    n = math.prod(shape)
    elem = torch.empty((), dtype=dtype).element_size()
    flat = torch.zeros(n + ALIGN // elem, dtype=dtype, device=device)
    start = (-flat.data_ptr() % ALIGN) // elem
    return flat[start:start + n].view(shape)


def pack(weights, biases) -> bool:
    """Move the weights [N_i, K] (Parameters) into one buffer, each part starting 256
    bytes aligned (zero rows between parts where N_i * K is not a multiple: a
    parameter of its own has that alignment, and aten hands it to cuBLASLt), each
    weight's `.data` a view of its part; the biases (if any) likewise, at the same rows
    of a bias buffer. True if packed (or already packed so), False where `packable`
    refuses (nothing changes then). Briefly holds one more copy of the weights."""
    if packable(weights, biases) is not None:
        return False
    has_bias = biases[0] is not None
    if layout([w.data for w in weights]) is not None and (
            not has_bias or layout([b.data for b in biases]) == layout([w.data for w in weights])):
        return True
    K, elem = weights[0].shape[1], weights[0].element_size()
    granule = _granule(K, elem, has_bias)
    offsets, rows = [], 0
    for w in weights:
        offsets.append(rows)
        rows += -(-w.shape[0] // granule) * granule
    rows = offsets[-1] + weights[-1].shape[0]
    with torch.inference_mode(False), torch.no_grad():  # (normal tensors, even if called in inference mode)
        for group, shape in ((weights, (rows, K)), (biases if has_bias else (), (rows,))):
            if not group:
                continue
            buffer = _aligned_zeros(shape, group[0].dtype, group[0].device)
            for p, off in zip(group, offsets):
                buffer[off:off + p.shape[0]].copy_(p.data)
            for p, off in zip(group, offsets):
                p.data = buffer[off:off + p.shape[0]]
    return True


def unpack(weights, biases) -> None:
    """Give each weight and bias its own storage again where they lie packed (the inverse
    of `pack`); otherwise leave them as they are."""
    for group in (weights, biases):
        if len(group) >= 2 and all(isinstance(p, torch.Tensor) for p in group) and \
                layout([p.data for p in group]) is not None:
            with torch.inference_mode(False), torch.no_grad():
                for p in group:
                    p.data = p.data.clone()


def _alignment(t) -> int:
    p = t.data_ptr() % ALIGN
    return ALIGN if p == 0 else p & -p


def plan_projections(x, weights, biases, tier: str = "lossless"):
    """The guard: a plan when the weights lie packed (`layout`), the biases too at the
    same rows (or all None), x on a CUDA device in their dtype with a contiguous last
    dimension of their K, and no autograd recording; else why the call takes the
    separate calls."""
    if not isinstance(x, torch.Tensor) or len(weights) < 2 or len(biases) != len(weights):
        return "x must be a tensor, with two or more weights and a bias (or None) each"
    if not x.is_cuda and not _params.INTERPRET_ON_CPU:
        return "CPU tensor (the packed GEMM is taken on CUDA devices)"
    if not all(isinstance(w, torch.Tensor) and w.dim() == 2 for w in weights):
        return "weights must be 2-D tensors"
    if type(x) not in _PLAIN or any(type(p) not in _PLAIN for p in (*weights, *biases) if p is not None):
        return "a tensor subclass: the separate calls"
    if x.dim() < 2 or x.shape[-1] != weights[0].shape[1] or x.stride(-1) != 1 or x.numel() == 0:
        return "x must be [..., K], the last dimension contiguous, not empty"
    if x.dtype != weights[0].dtype or x.device != weights[0].device:
        return "x and the weights differ in dtype or device"
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)
                                    or any(b is not None and b.requires_grad for b in biases)):
        return "autograd needs the separate calls"
    where = layout(weights)
    if where is None:
        return "the weights are not packed (bitfuse.ops.projections.pack)"
    bias = None
    if any(b is not None for b in biases):
        if any(not isinstance(b, torch.Tensor) or b.shape != (w.shape[0],) or b.dtype != x.dtype
               or b.device != x.device for b, w in zip(biases, weights)):
            return "biases must all be None, or [N_i] each in x's dtype and device"
        if layout(biases) != where:
            return "the biases are not packed at the weights' rows"
        bias = _span(biases[0], where[1])
    weight = _span(weights[0], where[1])
    sizes, offsets = tuple(w.shape[0] for w in weights), where[0]
    M = x.numel() // x.shape[-1]
    # x's strides too: aten's linear takes another path for an x it cannot flatten (matmul, then the
    # bias added on its own), which one fuzz case (fp32, rows padded) found to differ where the
    # contiguous x of the same shape had been verified
    key = (x.dtype, x.get_device(), f"M={M} K={x.shape[-1]} N={sizes} rows={offsets}+{where[1]}",
           "no bias" if bias is None else f"bias aligned {_alignment(bias)}",
           f"x {tuple(x.shape)} strides {x.stride()} aligned {_alignment(x)}", f"weight aligned {_alignment(weight)}",
           f"GEMM settings {gemm_settings(x.dtype)}")
    return ProjectionsPlan(x, weight, bias, sizes, offsets, key)


def _chunks(sizes, offsets, rows) -> tuple:
    """`split_with_sizes` sizes taking the parts and the gaps between them in turn."""
    out = []
    for i, (n, off) in enumerate(zip(sizes, offsets)):
        out.append(n)
        out.append((offsets[i + 1] if i + 1 < len(offsets) else rows) - off - n)
    return tuple(out)


def launch_projections(plan: ProjectionsPlan, out=None) -> tuple:
    """One `F.linear` on the packed weight; its column slices of the parts (`out` is not
    used: the GEMM allocates, as each separate call does)."""
    chunks = _chunks(plan.sizes, plan.offsets, plan.weight.shape[0])
    return tuple(F.linear(plan.x, plan.weight, plan.bias).split_with_sizes(chunks, -1)[::2])


def _packed_again(tensors, starts, shape, stride):
    """The span of tensors whose shapes, strides and dtypes are known (the site's key
    holds them) if their pointers lie at `starts` (bytes from the first's) inside the
    first one's storage, else None."""
    first = tensors[0]
    ptr = first.data_ptr()
    for t, start in zip(tensors, starts):
        if t.data_ptr() != ptr + start:
            return None
    storage = first.untyped_storage()
    if ptr + starts[-1] + (shape[1] if len(shape) == 2 else 1) * first.element_size() * tensors[-1].shape[0] > \
            storage.data_ptr() + storage.nbytes():
        return None
    return first.as_strided(shape, stride, first.storage_offset())


def bind_projections(plan: ProjectionsPlan):
    """`run(x, weights, biases)` for a call with the plan's metadata (the site's key holds
    the operands' shapes, strides, dtypes and pointer alignments): the packing is read
    again from the pointers each call (the parameters may have moved since), None where
    it no longer holds."""
    weight, bias, offsets = plan.weight, plan.bias, plan.offsets
    elem = weight.element_size()
    K, rows = weight.shape[1], weight.shape[0]
    chunks = _chunks(plan.sizes, offsets, rows)
    w_starts = tuple(off * K * elem for off in offsets)
    b_starts = tuple(off * elem for off in offsets)
    w_shape, w_stride, b_shape = (rows, K), (K, 1), (rows,)
    has_bias = bias is not None

    def run(x, weights, biases):
        w = _packed_again(weights, w_starts, w_shape, w_stride)
        if w is None:
            return None
        b = None
        if has_bias:
            b = _packed_again(biases, b_starts, b_shape, (1,))
            if b is None:
                return None
        return F.linear(x, w, b).split_with_sizes(chunks, -1)[::2]

    return run


def projections_reference(x, weights, biases) -> tuple:
    """The separate calls, as the modules make them: `F.linear(x, w_i, b_i)` each."""
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))


def projections(x, weights, biases) -> tuple:
    """Guarded but ungated: one GEMM where the weights are packed, else the separate calls.
    x [..., K]; weights [N_i, K]; biases [N_i] or None each. Returns [..., N_i] each."""
    plan = plan_projections(x, weights, biases)
    if plan.__class__ is str:
        return projections_reference(x, weights, biases)
    return launch_projections(plan)


def _laid_out_like(t: torch.Tensor) -> torch.Tensor:
    """A new, uninitialised tensor with `t`'s shape, strides, dtype, device and
    pointer alignment (its address modulo ALIGN)."""
    elem = t.element_size()
    span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    base = torch.empty(span + ALIGN // elem, dtype=t.dtype, device=t.device)
    offset = ((t.data_ptr() - base.data_ptr()) % ALIGN) // elem
    return base.as_strided(t.shape, t.stride(), offset)


def reduction_probe(plan: ProjectionsPlan) -> str | None:
    """None where the packed GEMM sums each output's K products as the separate calls
    do, for this plan's problem; else how they differ (`OpSpec.probe`).

    The call's own data proves little: two GEMM kernels that group the K products
    differently give the same 16-bit result on all but a few elements of most draws
    (the fuzz found 1 to 5 of up to 97,000 elements differing on a later draw at D =
    100, after a first draw had agreed). Here each output's sum holds a pair of
    terms +-2**20 (x's first and last columns 2**10, each weight row's first and last
    2**10 and -2**10) around the rest (normal draws): a partial sum that holds +2**20
    keeps its other terms to 2**-3, so any other grouping of the products changes
    the result in most outputs. The operands are laid out as the call's (x's shape,
    strides and alignment; the packed weight's and bias's rows and alignment), so
    cuBLAS picks the kernels it picks for the call. They are drawn in place, in the
    call's dtype: one more copy of the packed weight at a time (Sana's caption
    projections, every block's in one GEMM: 400 MB in bf16)."""
    from ..numerics import differing, same_bits

    x, weight, bias = plan.x, plan.weight, plan.bias
    gen = torch.Generator(device=x.device).manual_seed(0)

    def draw(t):
        return _laid_out_like(t).normal_(generator=gen)

    xp, wp = draw(x), draw(weight)
    xp[..., 0], xp[..., -1] = 2.0**10, 2.0**10
    wp[:, 0], wp[:, -1] = 2.0**10, -(2.0**10)
    bp = None if bias is None else draw(bias)
    packed = launch_projections(ProjectionsPlan(xp, wp, bp, plan.sizes, plan.offsets, plan.key))
    for i, (n, off) in enumerate(zip(plan.sizes, plan.offsets)):
        ref = F.linear(xp, wp[off : off + n], None if bp is None else bp[off : off + n])
        if not same_bits(packed[i], ref):
            return (f"on operands built to expose the order of the K sums, part {i} differs in "
                    f"{differing(packed[i], ref)} of {ref.numel()} elements: the packed GEMM sums K otherwise")
    return None


LAYOUTS = ("qkv", "qkv-bias", "kv-bias")  # three weights, no bias; with biases; two (a caption's k, v) with biases


def _make_args(case: cases.Case) -> tuple:
    """x [B, S, D]; three (or two) [D, D] weights scaled as a trained projection's (1 /
    sqrt(D)), biases per the layout, packed by `pack` (gaps between parts wherever D
    needs them for alignment), as a site receives them."""
    if case.layout not in LAYOUTS:
        raise ValueError(f"unknown projections layout {case.layout!r}; choose one of {', '.join(LAYOUTS)}")
    gen = case.generator()
    D = case.D
    n = 2 if case.layout == "kv-bias" else 3
    x = cases.activation(case, gen)
    x = _aligned_zeros(x.shape, x.dtype, x.device).copy_(x) if x.is_contiguous() else x

    def param(shape, scale):
        return torch.nn.Parameter(cases.draw(shape, case.dtype, "randn", gen, case.device, scale), requires_grad=False)

    weights = tuple(param((D, D), D ** -0.5) for _ in range(n))
    biases = (None,) * n if case.layout == "qkv" else tuple(param((D,), 1.0) for _ in range(n))
    pack(weights, biases)
    return x, weights, biases


SPEC = OpSpec(
    name="projections",
    reference=projections_reference,
    plan=plan_projections,
    launch={"lossless": launch_projections},
    bind={"lossless": bind_projections},
    make_args=_make_args,
    layouts=LAYOUTS,
    bandwidth_bound=False,
    probe=reduction_probe,
    may_differ="cuBLAS picks its GEMM kernel per problem, and the packed GEMM (N: the parts together) may get "
               "another one than the separate calls (on the H200: 2 rows in bf16 and fp16, 126 rows of fp32 "
               "without biases)",
)
