"""Every integration when its parameters move between calls: an offload cycle
(`model.to("cpu")` then back, diffusers' offloading, any `.data` swap), weights
replaced by others, a module replaced (as LoRA layers are injected).

The forward copies read each parameter where it is at the call, and so must the
host caches (Sana's packed caption projections, its modulation table rows) and the
CUDA graphs, which hold the addresses their capture read: the runner watches the
model's parameters and buffers (`graphs.model_tensors`) and captures again where
they moved. Each accelerated output is bitwise the stock model's under the same
changes. On CPU the sites fall back to their eager expressions and the graphs are
emulated (`EmulatedGraphBackend`, which raises where a CUDA graph would read the
memory a tensor left); on a GPU the kernels and real graphs run, in bf16."""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch

pytest.importorskip("diffusers")

import bitfuse  # noqa: E402
from bitfuse import graphs  # noqa: E402
from model_checks import TINY_INPUTS, assert_all_same, is_stock, outputs  # noqa: E402


def _first_block_linear(model) -> str:
    """The qualified name of a linear of the model's first block."""
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and ".0." in f".{name}.":
            return name
    raise AssertionError("no linear in a first block")


def _replace_linear(model, name: str, weight, bias) -> None:
    parent, _, child = name.rpartition(".")
    old = model.get_submodule(name)
    new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                          device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    setattr(model.get_submodule(parent), child, new)


@pytest.mark.parametrize("setup", ["cpu", "cpu-graphs", pytest.param("cuda", marks=pytest.mark.gpu),
                                   pytest.param("cuda-graphs", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(TINY_INPUTS))
def test_parameters_that_move_between_calls(name, setup):
    C = importlib.import_module(f"bitfuse.models.{name}_configs")
    cuda = setup.startswith("cuda")
    model = C.build_model(C.tiny_config(), device="cuda", dtype=torch.bfloat16) if cuda \
        else C.build_model(C.tiny_config())
    stock = copy.deepcopy(model)
    kwargs = C.make_inputs(model, **TINY_INPUTS[name])
    options = {}
    if setup.endswith("graphs"):
        options = dict(cuda_graphs=True, warmup=1)
        if not cuda:
            options["backend"] = graphs.EmulatedGraphBackend()
    handle = bitfuse.accelerate(model, **options)
    target = _first_block_linear(model)
    gen = torch.Generator().manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", graphs.GraphCaptureWarning)  # (moves are announced)
            assert_all_same(outputs(model, kwargs), outputs(stock, kwargs))
            assert_all_same(outputs(model, kwargs), outputs(stock, kwargs))
            # an offload cycle: every parameter in new memory, the same values
            if cuda:
                model.to("cpu")
                model.to("cuda")
            else:
                for p in model.parameters():
                    p.data = p.data.clone()
            assert_all_same(outputs(model, kwargs), outputs(stock, kwargs))
            # weights replaced by others (new memory, new values), in both models
            for m in (model, stock):
                lin = m.get_submodule(target)
                lin.weight.data = lin.weight.data * 1.5
            assert_all_same(outputs(model, kwargs), outputs(stock, kwargs))
            # a module replaced, as LoRA layers are injected
            old = model.get_submodule(target)
            weight = torch.randn(old.weight.shape, generator=gen).to(old.weight) * old.weight.float().std()
            bias = None if old.bias is None else torch.randn(old.bias.shape, generator=gen).to(old.bias) * 0.1
            for m in (model, stock):
                _replace_linear(m, target, weight, bias)
            assert_all_same(outputs(model, kwargs), outputs(stock, kwargs))
            assert_all_same(outputs(model, kwargs), outputs(stock, kwargs))
            if setup.endswith("graphs"):
                # the weights and the module replaced are moves; the offload cycle is one unless
                # the allocator gave every parameter its old address back (then the graphs
                # read the right memory); graphs are off after MAX_MOVES
                runner = handle.graphs
                assert runner.counts["moves"] >= 2 and runner.enabled is (runner.counts["moves"] < runner.MAX_MOVES)
    finally:
        handle.restore()
    assert is_stock(model)
    assert_all_same(outputs(model, kwargs), outputs(stock, kwargs))


@pytest.mark.parametrize("setup", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu),
                                   pytest.param("cuda-graphs", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ["sana", "flux"])
def test_diffusers_group_offloading(name, setup):
    """diffusers' group offloading (its hooks move each block's parameters onto the
    device for the block's call and off after), before and after accelerate: stock
    bits. On CPU both devices are the CPU (the hooks' interplay with the installed
    forwards); on the GPU the parameters live on the CPU between calls (with graphs,
    the runner sees them off the device and runs eagerly, without trying a capture)."""
    pytest.importorskip("accelerate")  # (diffusers' offloading imports it)
    C = importlib.import_module(f"bitfuse.models.{name}_configs")
    cuda = setup.startswith("cuda")
    device = torch.device("cuda" if cuda else "cpu")
    for order in ("offload first", "accelerate first"):
        model = C.build_model(C.tiny_config(), device="cuda", dtype=torch.bfloat16) if cuda \
            else C.build_model(C.tiny_config())
        kwargs = C.make_inputs(model, **TINY_INPUTS[name])
        ref = outputs(model, kwargs)
        offload = dict(onload_device=device, offload_device=torch.device("cpu"))
        if order == "offload first":
            model.enable_group_offload(**offload, offload_type="block_level", num_blocks_per_group=1)
        handle = bitfuse.accelerate(model, **(dict(cuda_graphs=True, warmup=1) if setup == "cuda-graphs" else {}))
        if order == "accelerate first":
            model.enable_group_offload(**offload, offload_type="leaf_level")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", graphs.GraphCaptureWarning)
                for _ in range(4):
                    assert_all_same(outputs(model, kwargs), ref)
            if setup == "cuda-graphs":
                counts = handle.graphs.counts
                assert counts["captures"] == 0 and counts["capture_failures"] == 0 and counts["eager"] == 4
        finally:
            handle.restore()


@pytest.mark.gpu
@pytest.mark.parametrize("graphs_on", [False, True], ids=["cuda", "cuda-graphs"])
@pytest.mark.parametrize("name", ["sana", "flux"])
def test_model_cpu_offload(name, graphs_on):
    """accelerate's model CPU offload (what a pipeline's `enable_model_cpu_offload` sets):
    its hook brings the whole model onto the GPU before the forward and leaves it there
    until the next model of the pipeline runs. With graphs, set before accelerate (the
    runner then calls the hook's forward), the warm-up brings the model over and the
    capture reads it there; after an offload the next call captures again. Stock bits."""
    accelerate = pytest.importorskip("accelerate")
    C = importlib.import_module(f"bitfuse.models.{name}_configs")
    model = C.build_model(C.tiny_config(), device="cuda", dtype=torch.bfloat16)
    kwargs = C.make_inputs(model, **TINY_INPUTS[name])
    ref = outputs(model, kwargs)
    model.to("cpu")
    model, hook = accelerate.cpu_offload_with_hook(model, execution_device="cuda")
    handle = bitfuse.accelerate(model, **(dict(cuda_graphs=True, warmup=1) if graphs_on else {}))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", graphs.GraphCaptureWarning)  # (the move after the offload)
            for cycle in range(2):
                for _ in range(3):
                    assert_all_same(outputs(model, kwargs), ref)
                hook.offload()  # the pipeline's next model runs: this one back to the CPU
                assert next(model.parameters()).device.type == "cpu"
        if graphs_on:
            counts = handle.graphs.counts
            assert counts["captures"] >= 1 and counts["replays"] >= 4 and counts["eager"] == 0, counts
    finally:
        handle.restore()
