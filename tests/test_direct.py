"""models._direct: a module call without nn.Module's machinery is the same call, and
anything that could step into the call (hooks, a compiled call, a subclass, an
instance forward, training-mode dropout) gets the module call."""

import pytest
import torch
from torch.nn.modules import module as nn_module

from bitfuse.models import _direct


def _modules():
    torch.manual_seed(0)
    return {
        "linear": (torch.nn.Linear(8, 5), torch.randn(3, 4, 8)),
        "linear without bias": (torch.nn.Linear(8, 5, bias=False), torch.randn(2, 8)),
        "conv": (torch.nn.Conv2d(4, 6, 3, padding=1, groups=2), torch.randn(2, 4, 5, 7)),
        "conv 1x1": (torch.nn.Conv2d(4, 6, 1, bias=False), torch.randn(2, 4, 5, 7).to(memory_format=torch.channels_last)),
        "dropout": (torch.nn.Dropout(0.3).eval(), torch.randn(3, 4)),
        "dropout p=0, training": (torch.nn.Dropout(0.0), torch.randn(3, 4)),
        "gelu": (torch.nn.GELU(approximate="tanh"), torch.randn(3, 4)),
    }


@pytest.mark.parametrize("name", list(_modules()))
def test_the_direct_call_is_the_module_call(name):
    module, x = _modules()[name]
    assert _direct.plain(module)
    ref = module(x)
    out = _direct.call(module, x)
    assert torch.equal(out, ref) and out.stride() == ref.stride() and out.dtype == ref.dtype
    if isinstance(module, torch.nn.Dropout):
        assert out is x and ref is x  # aten's dropout hands back its input then


def _counting(module):
    calls = []
    module.register_forward_hook(lambda m, args, out: calls.append(m))
    return calls


@pytest.mark.parametrize("name", ["linear", "conv", "dropout", "gelu"])
def test_hooks_get_the_module_call(name):
    module, x = _modules()[name]
    calls = _counting(module)
    assert not _direct.plain(module)
    _direct.call(module, x)
    assert calls == [module]

    module2, _ = _modules()[name]
    pre = []
    module2.register_forward_pre_hook(lambda m, args: pre.append(m))
    _direct.call(module2, x)
    assert pre == [module2]


def test_global_hooks_get_the_module_call():
    module, x = _modules()["linear"]
    calls = []
    handle = nn_module.register_module_forward_hook(lambda m, args, out: calls.append(m))
    try:
        assert not _direct.plain(module)
        _direct.call(module, x)
    finally:
        handle.remove()
    assert calls == [module]
    assert _direct.plain(module)


def test_a_subclass_an_instance_forward_and_a_compiled_call_are_called_as_modules():
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    x = torch.randn(3, 8)
    sub = Scaled(8, 5)
    assert torch.equal(_direct.call(sub, x), sub(x))

    inst = torch.nn.Linear(8, 5)
    inst.forward = lambda x: torch.zeros(1)
    assert torch.equal(_direct.call(inst, x), torch.zeros(1))

    compiled = torch.nn.Linear(8, 5)
    compiled._compiled_call_impl = lambda x: torch.ones(1)  # what module.compile() sets
    assert not _direct.plain(compiled)
    assert torch.equal(_direct.call(compiled, x), torch.ones(1))


def test_training_dropout_is_called():
    torch.manual_seed(1)
    module = torch.nn.Dropout(0.5)
    x = torch.ones(64, 64)
    out = _direct.call(module, x)
    assert out is not x and (out == 0).any() and (out == 2).any()


def test_invalid_dropout_probability_raises_as_eager():
    module = torch.nn.Dropout(0.5).eval()
    module.p = 1.5
    with pytest.raises(ValueError):
        module(torch.ones(2))
    with pytest.raises(ValueError):
        _direct.call(module, torch.ones(2))


def test_a_tensor_subclass_reaches_the_module():
    class Tagged(torch.Tensor):
        pass

    module = torch.nn.Dropout(0.2).eval()
    x = torch.randn(3, 4).as_subclass(Tagged)
    out = _direct.call(module, x)
    assert type(out) is Tagged and torch.equal(out, module(x))


def test_item_is_module_list_indexing():
    """`item(modules, i)` is `modules[i]`: for an nn.ModuleList after deletions and
    insertions (which renumber its keys), for negative indices, out of range (the same
    IndexError) and for other containers."""
    a, b, c, d = (torch.nn.Linear(2, 2) for _ in range(4))
    ml = torch.nn.ModuleList([a, b, c])
    del ml[0]
    ml.insert(1, d)
    for i in range(-len(ml), len(ml)):
        assert _direct.item(ml, i) is ml[i]
    with pytest.raises(IndexError):
        _direct.item(ml, len(ml))
    seq = torch.nn.Sequential(a, b)
    assert _direct.item(seq, 1) is seq[1] and _direct.item([a, b], 0) is a


def test_identity_is_a_dropout_that_returns_its_input():
    """`identity(module)`: the module call returns its input itself (eval-mode or p = 0
    dropout, nothing stepping in); a training dropout, a hooked one, a subclass or any
    other module: no."""
    for name in ("dropout", "dropout p=0, training"):
        module, x = _modules()[name]
        assert _direct.identity(module) and module(x) is x
    assert not _direct.identity(torch.nn.Dropout(0.3))  # training
    assert not _direct.identity(_modules()["gelu"][0])
    hooked = torch.nn.Dropout(0.3).eval()
    hooked.register_forward_hook(lambda m, args, out: None)
    assert not _direct.identity(hooked)

    class Sub(torch.nn.Dropout):
        pass

    assert not _direct.identity(Sub(0.3).eval())
