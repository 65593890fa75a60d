"""Module calls without `nn.Module.__call__`'s machinery, where that is the same call.

A faithful copy writes `_direct.call(attn.to_q, x)` where diffusers writes
`attn.to_q(x)`. When nothing can step into the call (no hooks on the module, no
global module hooks, no `module.compile()`, no TorchScript tracing, no torch.compile
tracing), `module(x)` is `module.forward(x)`: `nn.Module._call_impl`'s own fast path.
`call` makes that call directly, and for these torch classes themselves (not
subclasses such as PEFT's LoRA layers or a quantised linear, which keep their module
call) the forward's body:

    nn.Linear                          -> F.linear(x, weight, bias)
    nn.Dropout, eval mode or p == 0    -> x (aten's dropout returns its input itself then)
    nn.Conv2d, zero padding            -> F.conv2d(x, weight, bias, stride, padding, dilation, groups)

Anything else is called as a module. A host-bound model makes a dozen such calls a
block (Sana: the projections, the dropouts, the attention modules, the feed-forward);
each skips two Python frames and the forward's attribute lookups, a few microseconds
of host time (bench/NOTES.md). Under `torch.compile` the copies trace the module
calls as diffusers writes them.
"""

import torch
import torch.nn.functional as F

from .. import sites

__all__ = ["call", "identity", "item", "plain"]


def plain(module) -> bool:
    """Calling `module` now is exactly `module.forward(...)`: `sites.unhooked` (no hooks
    of its own or global, no compiled call) and no tracing of any kind."""
    return sites.unhooked(module) and not (torch._C._get_tracing_state() or torch.compiler.is_compiling())


def call(module, x, *args, **kwargs):
    """`module(x, *args, **kwargs)`, without the module machinery where `plain(module)`."""
    if not plain(module):
        return module(x, *args, **kwargs)
    cls = type(module)
    if args or kwargs or "forward" in module.__dict__:
        return module.forward(x, *args, **kwargs)
    if cls is torch.nn.Linear:
        p = module._parameters
        return F.linear(x, p["weight"], p["bias"])
    if cls is torch.nn.Dropout and type(x) is torch.Tensor and _dropout_off(module):
        return x
    if cls is torch.nn.Conv2d and module.padding_mode == "zeros":
        p = module._parameters
        return F.conv2d(x, p["weight"], p["bias"], module.stride, module.padding, module.dilation, module.groups)
    return module.forward(x)


def identity(module) -> bool:
    """Calling `module` now returns its input itself: an `nn.Dropout` (the class itself)
    in eval mode or with p = 0, `plain`, without an instance forward (`call`'s own case)."""
    return type(module) is torch.nn.Dropout and "forward" not in module.__dict__ and plain(module) \
        and _dropout_off(module)


def _dropout_off(module) -> bool:
    return module.p == 0 or (not module.training and 0 <= module.p <= 1)


def item(modules, i: int):
    """`modules[i]` for an `nn.ModuleList` (the class itself) without its index
    arithmetic: the module registered under `str(i)`, for i >= 0; anything else indexed
    as written."""
    if type(modules) is torch.nn.ModuleList and i >= 0:
        m = modules._modules.get(str(i))
        if m is not None:
            return m
    return modules[i]
