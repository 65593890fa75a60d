"""What every model integration shares: installing faithful forwards on one model
instance, the version pin of the copied diffusers code, the handle, and undoing it all.

A model file (`ltx2.py`, and the ones to come) declares what it copies and where it
goes, and its `accelerate` is one call:

    SOURCES = CopiedSources("LTX-2", release="0.42", copied_from="0.42.1",
                            sha256=VERIFIED_SOURCES, stock=stock_functions, copies=lambda: COPIES)

    def accelerate(model, *, quality="lossless", force=False):
        return _install.accelerate(
            model, LTX2Handle, quality=quality, force=force, sources=SOURCES,
            model_class=LTX2VideoTransformer3DModel,
            forwards={LTX2VideoTransformerBlock: _block_forward, ...},   # class -> our copy of its forward
            processors={LTX2AudioVideoAttnProcessor: _AttnProcessor},    # stock processor class -> ours
            sites=_sites)                                                # model -> [(name, module, norms)]

Installs are per instance and reversible: a forward goes into the instance's
`__dict__` (or, under hooks, where the hook keeps the stock forward: HF
accelerate's `_old_forward`, diffusers' HookRegistry); a processor instance
switches `__class__`, keeping its state. `handle.restore()` undoes them in reverse.
Nothing here is specific to a model.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import inspect
import re
import threading
import types
import warnings
from typing import Callable, Iterable, Mapping

import torch

from .. import graphs, policy
from .. import sites as _sites

__all__ = [
    "UnsupportedModelError",
    "UnsupportedVersionError",
    "AlreadyAcceleratedError",
    "CopiedSources",
    "ForwardSwap",
    "ClassSwap",
    "Handle",
    "accelerate",
    "processor_parameters",
    "release_matches",
    "version_of",
]


class UnsupportedModelError(TypeError):
    """No bitfuse support for this model (its type, or something about this instance)."""


class UnsupportedVersionError(RuntimeError):
    """The installed diffusers is not the one whose code a model file copied."""


class AlreadyAcceleratedError(RuntimeError):
    """accelerate() was called again, with another quality, on an accelerated model."""


# ---------------------------------------------------------------- the version pin


def release_matches(version: str, release: str) -> bool:
    """Whether `version` (e.g. "0.42.2.dev0") is on the release line `release` (e.g. "0.42")."""
    m = re.match(r"^\s*(\d+)\.(\d+)", version)
    return m is not None and f"{int(m.group(1))}.{int(m.group(2))}" == release


def _source_sha(fn) -> str | None:
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (OSError, TypeError):
        return None


@dataclasses.dataclass(frozen=True)
class CopiedSources:
    """The diffusers code a model file copies (or relies on), pinned.

    model: the model's name, for messages ("LTX-2").
    release: the diffusers release line the copies are valid for ("0.42": 0.42.x).
    copied_from: the exact version they were copied from ("0.42.1").
    sha256: qualified name -> sha256 of `inspect.getsource` of the stock function, as
        shipped in `copied_from` (the dict itself is read at each check).
    stock: `() -> {qualified name: the installed diffusers function}`, same keys.
    copies: `() -> {qualified name: our line-for-line copy}` for the names copied
        line for line (a subset of the keys); tests/test_copies.py diffs each against
        its stock function and requires every difference to be marked.
    """

    model: str
    release: str
    copied_from: str
    sha256: Mapping[str, str]
    stock: Callable[[], Mapping[str, Callable]]
    copies: Callable[[], Mapping[str, Callable]] = dict

    @property
    def supported(self) -> str:
        return f"{self.release}.x"

    def problems(self) -> list[str]:
        """Why the installed diffusers may not match the copies (empty: it does)."""
        import diffusers

        found = []
        version = getattr(diffusers, "__version__", "unknown")
        if not release_matches(version, self.release):
            found.append(f"diffusers {version} is outside the supported range {self.supported}")
        stock = self.stock()
        for name, verified in self.sha256.items():
            sha = _source_sha(stock[name]) if name in stock else None
            if sha is None:
                found.append(f"the source of diffusers' {name} cannot be read to verify it")
            elif sha != verified:
                found.append(
                    f"diffusers' {name} differs from the source bitfuse copied "
                    f"(sha256 {sha[:12]}, verified {verified[:12]})"
                )
        return found

    def check(self, force: bool = False) -> list[str]:
        """Refuse (UnsupportedVersionError) a diffusers whose code differs from the
        copies: a version off the release line, or a pinned function whose source
        changed. With `force=True`, warn instead. Returns the problems found."""
        found = self.problems()
        if found:
            msg = (
                f"bitfuse's {self.model} forwards are faithful copies of diffusers {self.supported} "
                f"(verified on {self.copied_from}): " + "; ".join(found)
            )
            if not force:
                raise UnsupportedVersionError(
                    msg + f". Install diffusers {self.supported}, or pass force=True to accelerate anyway "
                    "(output may then differ from this diffusers' model)."
                )
            warnings.warn(msg + "; accelerating anyway because force=True", UserWarning, stacklevel=4)
        return found


# ---------------------------------------------------------------- attention forwards

_call_parameters: dict = {}  # processor class -> the parameter names of its __call__


def processor_parameters(processor, cacheable: Iterable[type]) -> set:
    """`set(inspect.signature(processor.__call__).parameters)`, as diffusers' attention
    forwards compute it on every call (tens of microseconds of host time), kept per
    class for the classes in `cacheable` (exactly those) whose `__call__` the instance
    does not override."""
    cls = type(processor)
    if "__call__" not in getattr(processor, "__dict__", {}):
        known = _call_parameters.get(cls)
        if known is not None:
            return known
    names = set(inspect.signature(processor.__call__).parameters.keys())
    if cls in cacheable and "__call__" not in getattr(processor, "__dict__", {}):
        _call_parameters[cls] = names
    return names


# ---------------------------------------------------------------- per-instance swaps


def _is_bound(f, func, module) -> bool:
    return isinstance(f, types.MethodType) and f.__func__ is func and f.__self__ is module


def _slots(module):
    """Places that can hold a module's innermost forward: the instance attribute
    (no wrapper), HF accelerate's `_old_forward` (cpu offload hooks), and the
    function references of diffusers' hook registry (group offloading, caches, ...)."""
    yield module.__dict__, "forward"
    if "_old_forward" in module.__dict__:
        yield module.__dict__, "_old_forward"
    registry = module.__dict__.get("_diffusers_hook")
    for ref in getattr(registry, "_fn_refs", ()):
        yield ref.__dict__, "forward"
        yield ref.__dict__, "original_forward"


class ForwardSwap:
    """`ours` in place of the forward `stock` on one module instance; `undo()` puts
    back what was there.

    Without hooks, `ours` (bound) shadows the class forward in the instance's
    `__dict__`. When something already wraps the instance's forward, `ours` replaces
    `stock` (bound: the class's forward, or an earlier swap's) where the wrapper keeps
    it, so the wrapper keeps running around ours; a wrapper bitfuse does not
    recognise raises UnsupportedModelError."""

    __slots__ = ("module", "stock", "ours", "previous")

    def __init__(self, module: torch.nn.Module, stock: Callable, ours: Callable):
        self.module = module
        self.stock = stock
        self.ours = types.MethodType(ours, module)
        if "forward" not in module.__dict__:
            self.previous = _UNSET
            module.__dict__["forward"] = self.ours
            return
        for holder, key in _slots(module):
            if _is_bound(holder.get(key), stock, module):
                self.previous = holder[key]
                holder[key] = self.ours
                return
        raise UnsupportedModelError(
            f"the forward of {type(module).__name__} is wrapped by something bitfuse does not recognise "
            f"({module.__dict__['forward']!r}); accelerate the model before wrapping it"
        )

    def undo(self) -> None:
        module = self.module
        for holder, key in _slots(module):
            if holder.get(key) is self.ours:
                if self.previous is not _UNSET:
                    holder[key] = self.previous
                elif holder is module.__dict__ and key == "forward":
                    del holder[key]  # the class forward shows through again
                else:
                    holder[key] = types.MethodType(self.stock, module)


_UNSET = object()


_memo: contextvars.ContextVar[dict | None] = contextvars.ContextVar("bitfuse_forward_memo", default=None)


def forward_memo() -> dict | None:
    """A dict that lives for one call of an accelerated model's forward (the outermost
    one running here: a nested forward gets its own), or None outside one and under
    torch.compile tracing. For values every block of a forward would compute alike from
    the same tensor (Sana's caption projections); nothing in it outlives the call."""
    return _memo.get()


def version_of(t: torch.Tensor):
    """What a cache keeps to see in-place changes to `t`: its version counter, which
    every in-place op bumps. An inference tensor (made under `torch.inference_mode()`)
    has none, and its in-place changes there leave no trace, so for it a new object,
    equal to nothing: a cache that compares versions never hits on it and computes
    what stock computes. (Reading `_version` of one raises.)"""
    return object() if t.is_inference() else t._version


def scoped_forward(func: Callable) -> Callable:
    """`func` (a forward) run inside `policy.background_compiles()`, so a model's
    first call compiles its kernels in parallel while eager computes it, and with a
    fresh `forward_memo()`; as is under torch.compile tracing."""

    @functools.wraps(func)
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return func(self, *args, **kwargs)
        token = _memo.set({})
        try:
            with policy.background_compiles():
                return func(self, *args, **kwargs)
        finally:
            _memo.reset(token)

    return forward


class ClassSwap:
    """One object's `__class__` switched from a stock class to ours (a subclass
    overriding methods), keeping the object's state; `undo()` switches it back."""

    __slots__ = ("obj", "stock", "ours")

    def __init__(self, obj, ours: type):
        self.obj = obj
        self.stock = type(obj)
        self.ours = ours
        obj.__class__ = ours

    def undo(self) -> None:
        if type(self.obj) is self.ours:
            self.obj.__class__ = self.stock


class PackedLinears:
    """The weights of `nn.Linear` modules that read the same input packed into one
    buffer, their biases into another (`sites.pack_linears`; not at all where it
    refuses), so that `sites.linear_projections_site` makes one GEMM of them; `undo()`
    gives each its own storage again. The same Parameters and values throughout."""

    __slots__ = ("linears", "packed")

    def __init__(self, linears):
        self.linears = tuple(linears)
        self.packed = _sites.pack_linears(*self.linears)

    def undo(self) -> None:
        if self.packed:
            _sites.unpack_linears(*self.linears)


# ---------------------------------------------------------------- the handle

_lock = threading.RLock()  # accelerate and restore, across models and threads


class Handle:
    """What `accelerate` installed on one model; `restore()` undoes it.

    model: the accelerated module. quality: the tier mounted on its sites.
    pipeline: the pipeline it was taken from, or None. active: installed, not restored.
    graphs: the GraphRunner replaying the forward (accelerate(cuda_graphs=True) or
        `enable_graphs`), or None; restore() restores it first.
    sites: the model's marked sites while active.
    Usable as a context manager (restores on exit)."""

    def __init__(self, model: torch.nn.Module, quality: str):
        self.model = model
        self.quality = quality
        self.pipeline = None
        self.graphs = None
        self.active = False
        self._installs: list = []  # ForwardSwap / ClassSwap, undone in reverse
        self._marked: list[torch.nn.Module] = []
        self._cleanups: list[Callable[[], None]] = []

    @property
    def sites(self) -> list:
        return _sites.sites_of(self.model) if self.active else []

    def on_restore(self, fn: Callable[[], None]) -> None:
        """Run `fn()` when the handle is restored, after the installs are undone
        (e.g. clearing a cache the accelerated forward keeps); once per `fn`."""
        if fn not in self._cleanups:
            self._cleanups.append(fn)

    def graph_options(self) -> dict:
        """The GraphRunner options that graphing this model's accelerated forward
        needs: the tiers mounted on its sites in the signature (a graph captured under
        one tier never replays under another). Integrations add `prepare`/`hoist`."""
        marked = _sites.sites_of(self.model)

        def mounted_tiers():
            return tuple(sorted({s.tier for s in marked}, key=str))

        return {"context": mounted_tiers, "name": f"{type(self.model).__name__}.forward"}

    def enable_graphs(self, **options):
        """Replay the accelerated forward from CUDA graphs (bitfuse.graphs), one per
        call signature; options go to GraphRunner (max_graphs, warmup, backend, ...).
        Returns the runner, also kept as `handle.graphs` (replacing an earlier one)."""
        with _lock:
            if not self.active:
                raise RuntimeError("this handle was restored; accelerate the model again first")
            if self.graphs is not None:
                self.graphs.restore()
            self.graphs = graphs.wrap_model_for_graphs(self.model, **{**self.graph_options(), **options})
            return self.graphs

    def restore(self) -> None:
        """Put the stock forwards and processor classes back and unmark the sites
        (the graph runner first, the cleanups last). Idempotent."""
        with _lock:
            runner, self.graphs = self.graphs, None
            if runner is not None:
                runner.restore()
            for install in reversed(self._installs):
                install.undo()
            self._installs.clear()
            for module in self._marked:
                _sites.unmark_site(module)
            self._marked.clear()
            cleanups, self._cleanups = self._cleanups, []
            for fn in cleanups:
                fn()
            if self.model.__dict__.get("_bitfuse_handle") is self:
                del self.model.__dict__["_bitfuse_handle"]
            self.active = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()

    def __repr__(self) -> str:
        state = "active" if self.active else "restored"
        graphs = ", cuda graphs" if self.graphs is not None else ""
        return (
            f"<bitfuse {type(self).__name__} {state}: {type(self.model).__name__}, "
            f"{len(self._marked)} sites, quality={self.quality!r}{graphs}>"
        )


# ---------------------------------------------------------------- accelerate


def _replaced_class(module, forwards: Mapping[type, Callable]) -> type | None:
    """The class in `forwards` whose forward `module` runs as is, if any."""
    for cls in forwards:
        if type(module).forward is cls.forward:
            return cls
    return None


def accelerate(
    model: torch.nn.Module,
    handle_class: type[Handle],
    *,
    quality: str,
    force: bool,
    sources: CopiedSources,
    model_class: type,
    forwards: Mapping[type, Callable],
    processors: Mapping[type, type] | None = None,
    sites: Callable[[torch.nn.Module], Iterable[tuple[str, torch.nn.Module, tuple]]],
    projections: Callable[[torch.nn.Module], Iterable[tuple]] | None = None,
) -> Handle:
    """Install a model integration on `model`, all or nothing; returns its handle.

    handle_class: the Handle (sub)class to create, as `handle_class(model, quality)`.
    quality: the tier mounted on every site. force: accelerate despite a diffusers
        that fails `sources.check` (warns).
    model_class: what `model` must be an instance of (UnsupportedModelError otherwise).
    forwards: stock class -> our copy of its forward; every module of `model` that
        runs that class's forward as is gets ours (a subclass overriding it keeps its own).
    processors: stock processor class -> ours (a subclass): every module's
        `.processor` of exactly that class switches class; other processors stay.
    sites: `sites(model)` -> (name, module, norms) for each module to mark as a site
        (norms: what a one-pass kernel of the tier must handle); each must run a
        forward from `forwards`, else UnsupportedModelError (its own forward would
        bypass the sites).
    projections: `projections(model)` -> tuples of `nn.Linear` modules that the
        copies pass to `sites.linear_projections_site` together: each group's weights
        and biases are packed (`PackedLinears`, where they can be) and unpacked on
        restore.

    Called again on an accelerated model: the same quality returns the existing
    handle, another raises AlreadyAcceleratedError. On any error everything
    installed so far is undone before the error propagates."""
    policy.check_tier(quality)
    if not isinstance(model, model_class):
        raise UnsupportedModelError(f"expected diffusers' {model_class.__name__}, got {type(model).__name__}")
    processors = processors or {}
    with _lock:
        existing = model.__dict__.get("_bitfuse_handle")
        if existing is not None and existing.active:
            if existing.quality == quality:
                return existing
            raise AlreadyAcceleratedError(
                f"this model is already accelerated with quality={existing.quality!r}; call "
                f"handle.restore() first, or switch tiers per call with bitfuse.quality({quality!r})"
            )
        sources.check(force)
        marks = list(sites(model))
        for name, module, _ in marks:
            if _replaced_class(module, forwards) is None:
                stock = next((c for c in forwards if isinstance(module, c)), None)
                overridden = f"overrides {stock.__name__}.forward" if stock else "has no forward bitfuse copied"
                raise UnsupportedModelError(
                    f"{name} is {type(module).__name__}, which {overridden}; bitfuse would replace it"
                )
            if getattr(module, "_bitfuse_site", None) is not None:
                raise AlreadyAcceleratedError(f"{name} is already marked as a bitfuse site")

        handle = handle_class(model, quality)
        try:
            for module in model.modules():
                cls = _replaced_class(module, forwards)
                if cls is not None:
                    handle._installs.append(ForwardSwap(module, cls.forward, forwards[cls]))
            swapped = set()
            for module in model.modules():
                processor = getattr(module, "processor", None)
                if type(processor) in processors and id(processor) not in swapped:
                    handle._installs.append(ClassSwap(processor, processors[type(processor)]))
                    swapped.add(id(processor))
            for linears in (projections(model) if projections is not None else ()):
                handle._installs.append(PackedLinears(linears))
            for name, module, norms in marks:
                _sites.mark_site(module, name, norms=norms)
                handle._marked.append(module)
            # the model's innermost forward (ours or the class's) inside the first-call compile
            # scope; behind a wrapper bitfuse does not recognise, kernels compile in place
            root = _replaced_class(model, forwards)
            inner = forwards[root] if root is not None else type(model).forward
            try:
                handle._installs.append(ForwardSwap(model, inner, scoped_forward(inner)))
            except UnsupportedModelError:
                pass
            handle.active = True
            model.__dict__["_bitfuse_handle"] = handle
            _sites.mount(model, quality)
        except BaseException:
            handle.restore()
            raise
        return handle

