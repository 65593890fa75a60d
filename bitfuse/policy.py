"""The policy between kernels and sites: the first-sight gate and quality tiers.

The gate. A fast path is trusted on a platform only after it has been seen
to keep its contract there. The first eligible call of each signature (op,
tier, dtype, device, parameter layout, ...) runs the kernel (twice: the
compiling launch and the direct one, each into a NaN-poisoned output) and
eager, compares, and caches the verdict for the process: agreement enables the
signature; a mismatch or an exception disables it for good, warns once, and
returns eager's result. Verification never runs inside torch.compile tracing
or CUDA-graph capture: there an unverified signature takes eager. Inside
`background_compiles()` (an accelerated model's forward), a lossless first sight
whose kernel is not compiled yet starts the compile on a thread pool and returns
eager's result; the first call after the compile is the one verified.

Tiers, the contracts the gate checks:
- "lossless" (default): bitwise equal to eager (`numerics.same_bits`: signed
  zeros count, NaN equals NaN).
- "high": at least as accurate as eager against the float64 value of the same
  expression: every element within one ULP at the scale of the op's largest
  term, and a mean error no larger than eager's (`numerics.high_contract`); a
  miss falls back to the op's lossless kernel for that signature.
`with quality("high"):` selects a tier for the code inside it, per thread and
per asyncio task.

Bound launches. Once a call's signature is verified, a site may keep the op's
launch bound to its call's metadata (`OpSpec.bind`) under a key of everything its
guard reads (shapes, strides, dtypes, devices, parameters' kinds, tier); a later
call with the same key looks it up (`bound`) and launches without the planner or
the gate, a few microseconds of host time instead of tens. A mismatch or an error
recorded anywhere, `reset_verdicts` and `reload_env` drop every bound launch, and
none is kept under BITFUSE_VERIFY=always.

Environment: BITFUSE_DISABLE=1 sends every site to eager; BITFUSE_VERIFY=always
compares every call with eager, not only the first of each signature;
BITFUSE_COMPILE_THREADS sets the background compiles' threads (default: up to 8,
read at import).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from .numerics import differing, high_contract, same_bits  # noqa: F401  (same_bits: the lossless contract)
from .ops import _launch
from .ops.spec import TIERS, OpSpec

# ---------------------------------------------------------------- environment


def _env_flags() -> tuple[bool, bool]:
    disable = os.environ.get("BITFUSE_DISABLE", "0").strip().lower() not in ("", "0", "false", "no")
    verify = os.environ.get("BITFUSE_VERIFY", "").strip().lower()
    if verify not in ("", "once", "always"):
        warnings.warn(f"bitfuse: BITFUSE_VERIFY={verify!r} is neither 'once' nor 'always'; using 'once'",
                      UserWarning, stacklevel=2)
    return disable, verify == "always"


DISABLED, VERIFY_ALWAYS = _env_flags()


def reload_env() -> None:
    """Re-read BITFUSE_DISABLE and BITFUSE_VERIFY (they are read once, at import)."""
    global DISABLED, VERIFY_ALWAYS
    DISABLED, VERIFY_ALWAYS = _env_flags()
    _bound.clear()


# ---------------------------------------------------------------- quality tiers

_requested: contextvars.ContextVar[str | None] = contextvars.ContextVar("bitfuse_quality", default=None)


def check_tier(tier: str) -> str:
    """`tier` if it is a known tier, else ValueError naming the choices."""
    if tier not in TIERS:
        raise ValueError(f"unknown quality tier {tier!r}; choose one of {', '.join(TIERS)}")
    return tier


@contextlib.contextmanager
def quality(tier: str):
    """Select a tier for the code inside: `with bitfuse.quality("high"): ...`."""
    token = _requested.set(check_tier(tier))
    try:
        yield
    finally:
        _requested.reset(token)


def requested_quality() -> str | None:
    """The tier selected by an enclosing `quality(...)`, or None."""
    return _requested.get()


# ---------------------------------------------------------------- compiles in the background

_background: contextvars.ContextVar[bool | None] = contextvars.ContextVar("bitfuse_background", default=None)


@contextlib.contextmanager
def background_compiles(enabled: bool = True):
    """Inside, a lossless first sight whose kernel is not compiled yet starts its
    compile on a thread pool and returns eager's result (the same bits; high-tier
    kernels, whose bits differ from eager's, compile in place); a later call of that
    signature, once compiled, is the first sight the gate verifies. On leaving the
    outermost block, waits for the compiles it started, so the next call finds every
    kernel ready. An accelerated model's forward runs inside one: its first call
    costs about eager's plus the compiles in parallel, not one after another.
    `enabled=False` keeps compiles in place inside it, even within an enabled block
    (CUDA-graph warm-up uses it); an enabled block inside another changes nothing."""
    outer = _background.get()
    if outer is not None and (enabled or outer is False):
        yield
        return
    token = _background.set(bool(enabled))
    try:
        yield
    finally:
        _background.reset(token)
        if enabled:
            _launch.settle()


# ---------------------------------------------------------------- the gate


class FallbackWarning(UserWarning):
    """A fast path disagreed with eager (or failed) here and was disabled."""


@dataclass
class Verdict:
    """The gate's finding for one signature: "verified", "mismatch" or "error"."""

    op: str
    tier: str
    signature: str
    status: str
    device: str
    detail: str = ""

    @property
    def active(self) -> bool:
        return self.status == "verified"


_state: dict[tuple, bool] = {}  # key -> True (verified) / False (disabled)
_verdicts: dict[tuple, Verdict] = {}
_lock = threading.RLock()
_bound: dict = {}  # a site's call key -> the op's launch bound to it (verified signatures only)
MAX_BOUND = 4096

#: bound(site_key) -> the launch bound to that call key, or None (dict.get: no Python frame).
#: A bound launch takes the site's own arguments and returns the result, or None when this
#: call needs the planner after all (e.g. a pointer alignment its guard checks).
bound = _bound.get


def forget(site_key) -> None:
    """Drop one bound launch (a site whose bound launch raised: the gate then decides)."""
    _bound.pop(site_key, None)


def compiling() -> bool:
    """Inside torch.compile tracing."""
    return torch.compiler.is_compiling()


def capturing() -> bool:
    """Inside CUDA-graph capture on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _describe(key: tuple) -> str:
    op, tier, sig = key
    parts = []
    for p in sig:
        if isinstance(p, torch.dtype):
            parts.append(str(p).replace("torch.", ""))
        elif isinstance(p, int) or p is None:
            parts.append(f"cuda:{p}" if p is None or p >= 0 else "cpu")
        else:
            parts.append(str(p))
    return f"{op}[{tier}] " + " ".join(parts)


def _device_name(key: tuple) -> str:
    index = next((p for p in key[2] if isinstance(p, int)), None)
    if index is not None and index >= 0 and torch.cuda.is_available():
        return torch.cuda.get_device_name(index)
    return "CPU" if index is not None and index < 0 else "unknown device"


def _record(key: tuple, status: str, detail: str = "") -> Verdict:
    verdict = Verdict(key[0], key[1], _describe(key), status, _device_name(key), detail)
    _verdicts[key] = verdict
    _state[key] = status == "verified"
    if status != "verified":
        _bound.clear()  # (which bound launches served this signature is not kept: drop them all)
        fallback = "the lossless path" if key[1] == "high" else "eager PyTorch"
        warnings.warn(
            f"bitfuse: {verdict.signature} on {verdict.device} "
            f"{'broke its contract' if status == 'mismatch' else 'failed'}"
            f"{': ' + detail if detail else ''}; this path now runs {fallback} for the rest of the process",
            FallbackWarning,
            stacklevel=4,
        )
    return verdict


def gated(spec: OpSpec, tier: str, plan, args: tuple, fallback=None, site_key=None):
    """`spec.launch[tier](plan)` if that signature keeps its contract here, else
    `fallback(*args)` (default: eager `spec.reference(*args)`), verifying at first
    sight. `tier` is the kernel's tier (`spec.kernel_tier`); for "high" the
    fallback should be the lossless path. `site_key`: the caller's key for this
    call's metadata (see "Bound launches"); once the signature is verified, the
    launch bound to it (`spec.bind[tier](plan)`) is kept under that key."""
    key = (spec.name, tier, plan.key)
    state = _state.get(key)
    if state is True and not VERIFY_ALWAYS:
        try:
            out = spec.launch[tier](plan)
            if site_key is not None and tier in spec.bind:
                if len(_bound) >= MAX_BOUND:
                    _bound.clear()
                _bound[site_key] = spec.bind[tier](plan)
            return out
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if compiling() or capturing():
                raise
            with _lock:
                _record(key, "error", f"{type(exc).__name__}: {exc}")
            return (fallback or spec.reference)(*args)
    if state is False or compiling() or capturing():
        # never verified inside tracing or capture: an unverified path may not run there
        return (fallback or spec.reference)(*args)
    return _verify(key, spec, tier, plan, args, fallback)


def fact(name: str, sig: tuple, check) -> bool:
    """Whether a fact about the running build holds for signature `sig`, checked at first
    sight as the gate checks a kernel: `check()` (eager ops only, on the call's own
    operands) returns None where the fact holds, else why not. Recorded as a verdict
    (`name[lossless] <sig>`: listed by `verdicts`, a miss warns once and is kept for the
    process); False, without checking, inside tracing or capture (nothing unverified
    runs there) and under BITFUSE_DISABLE; checked on every call under
    BITFUSE_VERIFY=always. An exception in `check` is recorded as an error (False)."""
    key = (name, "lossless", sig)
    state = _state.get(key)
    if state is not None and not VERIFY_ALWAYS:
        return state
    if state is False or DISABLED or compiling() or capturing():
        return False
    with _lock:
        try:
            why = check()
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded: the fact does not hold here
            _record(key, "error", f"{type(exc).__name__}: {exc}")
            return False
        if why is None:
            if key not in _verdicts:
                _record(key, "verified")
            return True
        _record(key, "mismatch", why)
        return False


def _poisoned(ref):
    """NaN-filled outputs, row-major, as the launchers' `out=` takes them."""
    if ref.__class__ is tuple:
        return tuple(_poisoned(r) for r in ref)
    return torch.full(ref.shape, float("nan"), dtype=ref.dtype, device=ref.device)


def _same_layout(a, b) -> bool:
    """Whether a and b (tensors or tuples of them) have the same strides over their
    dimensions of size > 1."""
    if a.__class__ is tuple:
        return all(_same_layout(x, y) for x, y in zip(a, b))
    return all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1)


def _verify(key, spec: OpSpec, tier: str, plan, args: tuple, fallback):
    with _lock:
        state = _state.get(key)  # another thread may have reached the verdict while this one waited
        if state is False:
            return (fallback or spec.reference)(*args)
        if state is True and not VERIFY_ALWAYS:
            return spec.launch[tier](plan)
        ref = spec.reference(*args)
        launch = spec.launch[tier]
        try:
            # twice, each into a NaN-poisoned output: the first launch compiles through
            # Triton, the second takes the direct launcher every later call uses
            # only the lossless tier defers: its stand-in, eager's result, has the kernel's bits
            # (high's would not, and a high call must not change bits from one call to the next)
            defer = tier == "lossless" and _background.get()
            with _launch.deferring() if defer else contextlib.nullcontext() as deferred:
                out, again = launch(plan, out=_poisoned(ref)), launch(plan, out=_poisoned(ref))
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            _record(key, "error", f"{type(exc).__name__}: {exc}")
            return (fallback or spec.reference)(*args)
        if deferred is not None and deferred.pending:
            # a kernel is still compiling (background_compiles): eager's result, no verdict yet
            return ref if fallback is None else fallback(*args)
        if tier == "high" and spec.reference64 is not None:
            ref64, terms64 = spec.reference64(*args), spec.terms(*args)
            why = high_contract(out, ref, ref64, terms64) or high_contract(again, ref, ref64, terms64)
        else:
            pairs = tuple(zip(out, ref)) + tuple(zip(again, ref)) if ref.__class__ is tuple else ((out, ref), (again, ref))
            why = None
            if not all(same_bits(o, r) for o, r in pairs):
                n = sum(differing(o, r) for o, r in pairs[: len(pairs) // 2])
                total = sum(r.numel() for r in ref) if ref.__class__ is tuple else ref.numel()
                why = f"{n} of {total} elements differ bitwise from eager"
        if why is None:
            why = spec.probe_why(plan)
        if why is None:
            if key not in _verdicts:
                _record(key, "verified")
            # the poisoned buffers are row-major: where eager's result is laid out otherwise
            # (channels-last, permuted), eager's own result goes on (the same bits), since a
            # convolution or a GEMM reading it downstream picks its algorithm, and its bits,
            # by layout
            return out if _same_layout(out, ref) else ref
        _record(key, "mismatch", why)
        return ref if fallback is None else fallback(*args)


def state(spec: OpSpec, tier: str, plan) -> bool | None:
    """The gate's state for a call's signature: True (verified: the kernel runs),
    False (disabled: eager runs), None (not seen yet)."""
    return _state.get((spec.name, tier, plan.key))


def verdicts() -> list[Verdict]:
    """Every verdict reached in this process, in the order they were reached."""
    with _lock:
        return list(_verdicts.values())


def reset_verdicts() -> None:
    """Forget every verdict (tests, and `bitfuse verify`, start from first sight)."""
    with _lock:
        _state.clear()
        _verdicts.clear()
        _bound.clear()
