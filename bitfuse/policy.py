"""The policy between kernels and sites: the first-sight gate and quality tiers.

The gate. A fast path is trusted on a platform only after it has been seen
to agree with eager there. The first eligible call of each signature (op,
mode, dtype, device, parameter layout) runs both, compares, and caches the
verdict for the process: agreement enables the signature; a mismatch or an
exception disables it for good, warns once, and returns eager's result.
Verification never runs inside torch.compile tracing or CUDA-graph capture:
there an unverified signature takes eager.

Tiers. "lossless" (default) paths must be `torch.equal` to eager; "high"
paths must lie within one ULP of it. `with quality("high"):` selects a tier
for the code inside it, per thread and per asyncio task.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .numerics import same_values, within_one_ulp, within_one_ulp_at

TIERS = ("lossless", "high")

# ---------------------------------------------------------------- environment


def _env_flags() -> tuple[bool, bool]:
    disable = os.environ.get("BITFUSE_DISABLE", "0").strip().lower() not in ("", "0", "false", "no")
    verify = os.environ.get("BITFUSE_VERIFY", "").strip().lower()
    if verify not in ("", "once", "always"):
        raise ValueError(f"BITFUSE_VERIFY must be 'once' or 'always', got {verify!r}")
    return disable, verify == "always"


DISABLED, VERIFY_ALWAYS = _env_flags()


def reload_env() -> None:
    """Re-read BITFUSE_DISABLE and BITFUSE_VERIFY (they are read once, at import)."""
    global DISABLED, VERIFY_ALWAYS
    DISABLED, VERIFY_ALWAYS = _env_flags()


# ---------------------------------------------------------------- quality tiers

_requested: contextvars.ContextVar[str | None] = contextvars.ContextVar("bitfuse_quality", default=None)


def check_tier(tier: str) -> str:
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


# ---------------------------------------------------------------- the gate


class FallbackWarning(UserWarning):
    """A fast path disagreed with eager (or failed) here and was disabled."""


@dataclass
class Verdict:
    op: str
    mode: str
    signature: str
    status: str  # "verified" | "mismatch" | "error"
    device: str
    detail: str = ""

    @property
    def active(self) -> bool:
        return self.status == "verified"


_state: dict[tuple, bool] = {}  # key -> True (verified) / False (disabled)
_verdicts: dict[tuple, Verdict] = {}
_lock = threading.RLock()


def compiling() -> bool:
    """Inside torch.compile tracing."""
    return torch.compiler.is_compiling()


def capturing() -> bool:
    """Inside CUDA-graph capture on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_compiling, _capturing = compiling, capturing


def _describe(key: tuple) -> str:
    op, mode, sig = key
    parts = []
    for p in sig:
        if isinstance(p, torch.dtype):
            parts.append(str(p).replace("torch.", ""))
        elif isinstance(p, int) or p is None:
            parts.append(f"cuda:{p}")
        else:
            parts.append(str(p))
    return f"{op}[{mode}] " + " ".join(parts)


def _device_name(key: tuple) -> str:
    index = next((p for p in key[2] if isinstance(p, int)), None)
    if index is not None and torch.cuda.is_available():
        return torch.cuda.get_device_name(index)
    return "unknown device"


def _record(key: tuple, status: str, detail: str = "") -> Verdict:
    verdict = Verdict(key[0], key[1], _describe(key), status, _device_name(key), detail)
    _verdicts[key] = verdict
    _state[key] = status == "verified"
    if status != "verified":
        warnings.warn(
            f"bitfuse: {verdict.signature} on {verdict.device} "
            f"{'disagreed with eager' if status == 'mismatch' else 'failed'}"
            f"{': ' + detail if detail else ''}; this path now runs eager PyTorch for the rest of the process",
            FallbackWarning,
            stacklevel=4,
        )
    return verdict


def gated(op: str, mode: str, plan, fast: Callable, reference: Callable, args: tuple, magnitude=None,
          ulps: int = 1):
    """Run `fast(plan)` if its signature is verified here, else eager `reference(*args)`,
    verifying at first sight. `mode` is "exact" (torch.equal) or "high": within
    `ulps` ULPs of eager at the scale `magnitude(*args)` of the op's terms (or
    within one ULP of the output, if no magnitude is given)."""
    key = (op, mode, plan.key)
    state = _state.get(key)
    if state is True and not VERIFY_ALWAYS:
        try:
            return fast(plan)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if _compiling() or _capturing():
                raise
            with _lock:
                _record(key, "error", f"{type(exc).__name__}: {exc}")
            return reference(*args)
    if state is False:
        return reference(*args)
    if _compiling() or _capturing():
        # no verification here: a verified path may run (above), an unverified one may not
        return reference(*args)
    return _verify(key, plan, fast, reference, args, magnitude, ulps)


def _verify(key, plan, fast, reference, args, magnitude, ulps):
    with _lock:
        if _state.get(key) is False:
            return reference(*args)
        try:
            # twice: the first launch compiles through Triton, the second takes the
            # direct launcher (ops._pointwise.FastLaunch) that every later call uses
            out, again = fast(plan), fast(plan)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            _record(key, "error", f"{type(exc).__name__}: {exc}")
            return reference(*args)
        ref = reference(*args)
        if ref.__class__ is tuple:  # ops with several outputs (rotary of query and key) are exact
            agree = all(same_values(o, r) and same_values(a, r) for o, a, r in zip(out, again, ref))
        elif key[1] == "exact":
            agree = same_values(out, ref) and same_values(again, ref)
        elif magnitude is not None:
            scale = magnitude(*args).maximum(ref.float().abs())
            agree = within_one_ulp_at(out, ref, scale, ulps) and within_one_ulp_at(again, ref, scale, ulps)
        else:
            agree = within_one_ulp(out, ref) and within_one_ulp(again, ref)
        if agree:
            if key not in _verdicts:
                _record(key, "verified")
            return out
        pairs = zip(out, ref) if ref.__class__ is tuple else ((out, ref),)
        n = sum(int((o != r).sum()) if o.shape == r.shape else r.numel() for o, r in pairs)
        total = sum(r.numel() for r in ref) if ref.__class__ is tuple else ref.numel()
        _record(key, "mismatch", f"{n} of {total} elements differ")
        return ref


def verdicts() -> list[Verdict]:
    """Every verdict reached in this process, in the order they were reached."""
    with _lock:
        return list(_verdicts.values())


def reset_verdicts() -> None:
    """Forget every verdict (tests, and `bitfuse verify`, start from first sight)."""
    with _lock:
        _state.clear()
        _verdicts.clear()
