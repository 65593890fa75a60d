"""Module calls without `nn.Module.__call__`'s machinery, where that is the same call.

A faithful copy writes `_direct.call(attn.to_q, x)` where diffusers writes
`attn.to_q(x)`. When nothing can step into the call (no hooks on the module, no
global module hooks, no `module.compile()`, no TorchScript tracing, no torch.compile
tracing), `module(x)` is `module.forward(x)`: `nn.Module._call_impl`'s own fast path.
`call` makes that call directly, and for these torch classes themselves (not
subclasses such as PEFT's LoRA layers or a quantised linear, which keep their module
call) the forward's body:

    nn.Linear                          -> F.linear(x, weight, bias), or where aten's linear
                                          takes matmul (below) the ops it runs there:
                                          mm(x.reshape(-1, C), weight.t()).view(B, N, O).add_(bias)
                                          or bmm(x, weight.t().expand(B, C, O)).add_(bias)
    nn.Dropout, eval mode or p == 0    -> x (aten's dropout returns its input itself then)
    nn.Conv2d, zero padding            -> F.conv2d(x, weight, bias, stride, padding, dilation, groups)

Anything else is called as a module. A host-bound model makes a dozen such calls a
block (Sana: the projections, the dropouts, the attention modules, the feed-forward);
each skips two Python frames and the forward's attribute lookups, a few microseconds
of host time (bench/NOTES.md).

The matmul forms are aten's own: `aten::linear` on a non-contiguous 3-D input with a
bias (Sana's `to_out` after its linear attention, whose output keeps a [B, C, N]
layout) calls `matmul(x, weight.t())` and adds the bias in place. matmul folds x into
a matrix (`reshape`, a copy here) for `mm` when the weight requires grad (even under
no_grad: its fold test reads `requires_grad`, diffusers' `from_pretrained` leaves it
set), else, when x's leading dimensions do not merge into a view, expands both
operands to [B, ...] (aliases: x itself and the weight's transposed view, batch
stride 0) for `bmm`. `call` makes those calls itself, a third of the dispatcher
calls (`tests/test_direct.py` checks them against aten's op list).

Under `torch.compile` the copies trace the module calls as diffusers writes them.
"""

import os

import torch
import torch.nn.functional as F

from .. import sites

__all__ = ["call", "plain"]


def plain(module) -> bool:
    """Calling `module` now is exactly `module.forward(...)`: `sites.unhooked` (no hooks
    of its own or global, no compiled call) and no tracing of any kind."""
    return sites.unhooked(module) and not (torch._C._get_tracing_state() or torch.compiler.is_compiling())


_FLATTEN_3D = os.environ.get("TORCH_LINEAR_FLATTEN_3D")  # aten's linear copies x contiguous when set


def _matmul_linear(x, weight, bias) -> bool:
    """Whether `F.linear(x, weight, bias)` for a non-contiguous 3-D x with a bias is
    `matmul(x, weight.t())` then `add_(bias)` in aten, and `call` may run those: plain
    tensors outside autograd and autocast, a 2-D weight and a 1-D bias, nothing empty
    (aten's fold test has a case of its own there), no TORCH_LINEAR_FLATTEN_3D."""
    if torch.is_grad_enabled() or _FLATTEN_3D or _autocast() or type(x) is not torch.Tensor:
        return False
    if not (_plain_tensor(weight) and _plain_tensor(bias)):  # (a subclass bias: aten adds out of place)
        return False
    return weight.dim() == 2 and bias.dim() == 1 and x.numel() != 0 and weight.numel() != 0


def _folds(x) -> bool:
    """matmul's fold test for a 3-D x and a 2-D operand that does not require grad: x's
    two leading dimensions merge into one without a copy."""
    stride = x.stride()
    return stride[0] == stride[1] * x.shape[1]


def _plain_tensor(t) -> bool:
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or torch.is_autocast_enabled


def call(module, x, *args, **kwargs):
    """`module(x, *args, **kwargs)`, without the module machinery where `plain(module)`."""
    if not plain(module):
        return module(x, *args, **kwargs)
    cls = type(module)
    if args or kwargs or "forward" in module.__dict__:
        return module.forward(x, *args, **kwargs)
    if cls is torch.nn.Linear:
        p = module._parameters
        weight, bias = p["weight"], p["bias"]
        if bias is not None and x.dim() == 3 and not x.is_contiguous() and _matmul_linear(x, weight, bias):
            if weight.requires_grad or _folds(x):
                B, N, C = x.shape
                return torch.mm(x.reshape(B * N, C), weight.t()).view(B, N, weight.shape[0]).add_(bias)
            return torch.bmm(x, weight.t().expand(x.shape[0], -1, -1)).add_(bias)
        return F.linear(x, weight, bias)
    if cls is torch.nn.Dropout and type(x) is torch.Tensor \
            and (module.p == 0 or (not module.training and 0 <= module.p <= 1)):
        return x
    if cls is torch.nn.Conv2d and module.padding_mode == "zeros":
        p = module._parameters
        return F.conv2d(x, p["weight"], p["bias"], module.stride, module.padding, module.dilation, module.groups)
    return module.forward(x)
