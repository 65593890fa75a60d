"""The model-agnostic install machinery (bitfuse.models._install), on a toy integration.

The toy below is what a model file looks like: stock classes (standing in for
diffusers'), a faithful copy of a forward with its change marked, the pinned
sources, and an `accelerate` that is one `_install.accelerate` call. Its copy is
checked by the same rule as the real ones (tests/test_copies.py)."""

from __future__ import annotations

import hashlib
import inspect
import re

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import bitfuse  # noqa: E402
from bitfuse import graphs, sites  # noqa: E402
from bitfuse.models import _install  # noqa: E402
from bitfuse.models._install import (  # noqa: E402
    AlreadyAcceleratedError,
    UnsupportedModelError,
    UnsupportedVersionError,
)
from bitfuse.numerics import same_bits  # noqa: E402

# ---------------------------------------------------------------- "stock" code


class Block(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim, elementwise_affine=False)
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x, scale, shift):
        h = self.norm(x) * (1 + scale) + shift
        return x + self.lin(h)


class Processor:
    def __init__(self):
        self.backend = "native"  # state a swap must keep

    def __call__(self, x):
        return x * 2


class Model(torch.nn.Module):
    def __init__(self, n=2, dim=8):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(n))
        self.table = torch.nn.Parameter(torch.randn(2, dim))
        self.processor = Processor()

    def forward(self, x):
        scale, shift = self.table.unbind(0)
        for block in self.blocks:
            x = block(x, scale, shift)
        return self.processor(x)


# ---------------------------------------------------------------- the integration


def _block_forward(self, x, scale, shift):
    """The toy's faithful copy of Block.forward."""
    # diffusers: h = self.norm(x) * (1 + scale) + shift
    h = sites.layer_norm_modulate_site(self, self.norm, x, scale, shift)
    return x + self.lin(h)


class OurProcessor(Processor):
    def __call__(self, x):
        return x * 2  # the same; a real one routes something through a site


cleared = []


class ToyHandle(_install.Handle):
    def __init__(self, model, quality):
        super().__init__(model, quality)
        self.on_restore(lambda: cleared.append(self))


def _sha(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


SHA256 = {"Block.forward": _sha(Block.forward)}
SOURCES = _install.CopiedSources(
    "Toy",
    release=".".join(diffusers.__version__.split(".")[:2]),
    copied_from=diffusers.__version__,
    sha256=SHA256,
    stock=lambda: {"Block.forward": Block.forward},
    copies=lambda: {"Block.forward": _block_forward},
)


def accelerate(model, *, quality="lossless", force=False):
    return _install.accelerate(
        model, ToyHandle, quality=quality, force=force, sources=SOURCES, model_class=Model,
        forwards={Block: _block_forward}, processors={Processor: OurProcessor},
        sites=lambda m: [(f"blocks.{i}", b, (b.norm,)) for i, b in enumerate(m.blocks)],
    )


# ---------------------------------------------------------------- tests


@pytest.fixture(autouse=True)
def _inference():
    cleared.clear()
    with torch.no_grad():
        yield


def _stock(model) -> bool:
    return (all("forward" not in m.__dict__ for m in model.modules()) and type(model.processor) is Processor
            and not sites.sites_of(model) and "_bitfuse_handle" not in model.__dict__)


def test_install_and_restore():
    torch.manual_seed(0)
    model, x = Model(), torch.randn(2, 3, 8)
    ref = model(x)
    processor = model.processor
    handle = accelerate(model)
    assert handle.active and handle.model is model and handle.quality == "lossless"
    assert [s.name for s in handle.sites] == ["blocks.0", "blocks.1"]
    assert all(s.tier == "lossless" for s in handle.sites)
    assert all(b.forward.__func__ is _block_forward for b in model.blocks)  # per instance:
    assert Block.forward is not _block_forward and Block(8).forward.__func__ is Block.forward  # the class is untouched
    assert type(model.processor) is OurProcessor and model.processor is processor and processor.backend == "native"
    assert same_bits(model(x), ref)
    assert repr(handle) == "<bitfuse ToyHandle active: Model, 2 sites, quality='lossless'>"
    assert accelerate(model) is handle  # same quality: the same handle
    with pytest.raises(AlreadyAcceleratedError, match="already accelerated with quality='lossless'"):
        accelerate(model, quality="high")
    handle.restore()
    assert _stock(model) and not handle.active and cleared == [handle] and handle.sites == []
    handle.restore()  # idempotent
    assert _stock(model) and cleared == [handle]
    assert same_bits(model(x), ref)


def test_the_toy_copy_passes_the_copy_rule():
    from test_copies import unfaithful

    for name, ours in SOURCES.copies().items():
        assert unfaithful(SOURCES.stock()[name], ours) == []


def test_refuses_what_it_would_break_and_installs_nothing():
    class OwnBlock(Block):
        def forward(self, x, scale, shift):
            return x

    model = Model()
    model.blocks[1] = OwnBlock()
    with pytest.raises(UnsupportedModelError, match=r"blocks\.1 is OwnBlock, which overrides Block\.forward"):
        accelerate(model)
    assert _stock(model)
    with pytest.raises(UnsupportedModelError, match="expected diffusers' Model, got Linear"):
        accelerate(torch.nn.Linear(2, 2))


def test_a_failure_midway_undoes_everything():
    """The high tier has no one-pass kernel for an affine LayerNorm: mounting fails
    after the forwards, processors and sites were installed; all of it is undone."""
    model = Model()
    model.blocks[0].norm = torch.nn.LayerNorm(8)  # affine
    with pytest.raises(bitfuse.MountError, match="affine"):
        accelerate(model, quality="high")
    assert _stock(model)
    accelerate(model).restore()


def test_sources_are_checked(monkeypatch):
    model = Model()
    monkeypatch.setitem(SHA256, "Block.forward", "0" * 64)
    with pytest.raises(UnsupportedVersionError, match=r"Block\.forward differs from the source bitfuse copied"):
        accelerate(model)
    assert _stock(model)
    with pytest.warns(UserWarning, match="force=True"):
        accelerate(model, force=True).restore()
    monkeypatch.setattr(diffusers, "__version__", "9.1.0")
    with pytest.raises(UnsupportedVersionError, match=r"diffusers 9\.1\.0 is outside the supported range"):
        accelerate(model)


@pytest.mark.parametrize("version,release,ok", [
    ("0.42.0", "0.42", True), ("0.42.2.dev0", "0.42", True), ("0.41.9", "0.42", False), ("1.42.0", "0.42", False),
    ("0.4.2", "0.42", False), ("v0.42", "0.42", False),
])
def test_release_matches(version, release, ok):
    assert _install.release_matches(version, release) is ok


def test_graphs_key_the_mounted_tiers_and_restore_first():
    torch.manual_seed(0)
    model, x = Model(), torch.randn(2, 3, 8)
    ref = model(x)
    handle = accelerate(model)
    runner = handle.enable_graphs(backend=graphs.EmulatedGraphBackend(), warmup=0)
    assert handle.graphs is runner and graphs.graph_runner_of(model) is runner
    assert same_bits(model(x), ref) and same_bits(model(x), ref)
    for site in handle.sites:
        site.tier = "high"  # what mounting another tier does
    assert same_bits(model(x), ref)
    assert runner.report()["captures"] == 2  # the mounted tiers are in the signature
    handle.restore()
    assert _stock(model) and not runner.enabled and handle.graphs is None
    with pytest.raises(RuntimeError, match="restored"):
        handle.enable_graphs()


def test_class_swap_and_forward_swap_undo():
    obj = Processor()
    swap = _install.ClassSwap(obj, OurProcessor)
    assert type(obj) is OurProcessor
    swap.undo()
    swap.undo()
    assert type(obj) is Processor
    block = Block()
    fswap = _install.ForwardSwap(block, Block.forward, _block_forward)
    assert block.forward.__func__ is _block_forward
    fswap.undo()
    assert "forward" not in block.__dict__
    block.forward = lambda *a: None  # a wrapper bitfuse does not know
    with pytest.raises(UnsupportedModelError, match="does not recognise"):
        _install.ForwardSwap(block, Block.forward, _block_forward)


def test_docstrings_of_the_public_api():
    for obj in (_install.accelerate, _install.Handle, _install.Handle.restore, _install.Handle.enable_graphs,
                _install.CopiedSources, _install.CopiedSources.check, _install.ForwardSwap, _install.ClassSwap):
        assert obj.__doc__ and len(obj.__doc__.strip()) > 20, obj
    assert re.search(r"\bforwards\b.*\bprocessors\b.*\bsites\b", _install.accelerate.__doc__, re.S)


def test_the_forward_runs_inside_background_compiles(monkeypatch):
    """accelerate() runs the model's forward inside policy.background_compiles (the
    first call compiles its kernels in parallel), keeps the forward's signature,
    lets an enclosing block decide, waits for the compiles on the way out, and
    restore() takes it off."""
    import inspect

    from bitfuse import policy
    from bitfuse.ops import _launch

    settled, seen = [], []
    monkeypatch.setattr(_launch, "settle", lambda: settled.append(1))
    model, x = Model(), torch.randn(2, 3, 8)
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(policy._background.get()))
    stock_signature = inspect.signature(model.forward)
    handle = accelerate(model)
    assert inspect.signature(model.forward) == stock_signature
    model(x)
    assert seen == [True] and settled == [1]
    with policy.background_compiles(False):
        model(x)
    assert seen == [True, False] and settled == [1]
    handle.restore()
    assert _stock(model)
    model(x)
    assert seen == [True, False, None]


def test_the_compile_scope_goes_inside_a_hook_wrapper_and_comes_out():
    """Under HF accelerate's hook pattern (`forward` wraps `_old_forward`), the scope
    replaces `_old_forward` (the wrapper stays `model.forward`); restore() puts the
    stock `_old_forward` back."""
    import functools

    from bitfuse import policy

    model, x = Model(), torch.randn(2, 3, 8)
    seen = []
    model._old_forward = model.forward

    def hooked(module, *args, **kwargs):
        seen.append(("hook", policy._background.get()))
        return module._old_forward(*args, **kwargs)

    model.forward = functools.update_wrapper(functools.partial(hooked, model), model._old_forward)
    wrapper = model.forward
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(("block", policy._background.get())))
    handle = accelerate(model)
    assert model.forward is wrapper and model._old_forward.__func__.__wrapped__ is Model.forward  # ours, around it
    model(x)
    assert seen == [("hook", None), ("block", True)]
    handle.restore()
    assert model.forward is wrapper and model._old_forward.__func__ is Model.forward


def test_processor_parameters_are_kept_only_for_the_classes_named():
    """Cached per class for the classes named, never for another class or an instance
    that overrides `__call__` (its own names every call)."""

    class Listed:
        def __call__(self, attn, hidden_states, extra=None):
            return hidden_states

    class Other(Listed):
        pass

    _install._call_parameters.pop(Listed, None)
    names = {"attn", "hidden_states", "extra"}
    assert _install.processor_parameters(Listed(), {Listed}) == names
    assert _install._call_parameters[Listed] == names
    assert _install.processor_parameters(Other(), {Listed}) == names and Other not in _install._call_parameters
    own = Listed()
    own.__call__ = lambda attn, only=None: None  # an instance override: its own names, never cached
    assert _install.processor_parameters(own, {Listed}) == {"attn", "only"}
    assert _install._call_parameters[Listed] == names
    _install._call_parameters.pop(Listed, None)
