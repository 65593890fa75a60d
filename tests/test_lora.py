"""LoRA adapters (diffusers' PEFT integration: `add_adapter`, `set_adapters`,
`disable_adapters`, `fuse_lora`, `delete_adapters`) on an accelerated model.

PEFT replaces each targeted linear by a LoRA layer that wraps it; the installed
forwards call the module where diffusers does, so the layer runs (the direct-call
and packed-projection paths take `nn.Linear` itself only). Adapters are added
before and after accelerate; each output is bitwise the stock model's under the
same adapter operations, each adapter changes the output, and disabled adapters
give the adapter-free model's bits. The LoRA scales and switches are Python state
a CUDA graph would bake in, so the graphs cases also check that a change of them is
seen (the runner keys its graphs by the model's adapter state). On CPU the sites
fall back to their eager expressions and the graphs are emulated; on a GPU the
kernels and real graphs run, in bf16."""

from __future__ import annotations

import copy
import importlib
import inspect
import warnings

import pytest
import torch

pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

import bitfuse  # noqa: E402
from bitfuse import graphs  # noqa: E402
from bitfuse.numerics import same_bits  # noqa: E402
from model_checks import TINY_INPUTS, assert_all_same, is_stock, outputs  # noqa: E402

# the attention projections every integration has, and the output projections
# (FLUX's single blocks, every model's last layer)
_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]


def _add(models, name: str, seed: int) -> None:
    """The same adapter `name` (random A and B: not the identity) on each of `models`."""
    for m in models:
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=_TARGETS, init_lora_weights=False),
                          adapter_name=name)


@pytest.mark.parametrize("setup", ["cpu", "cpu-graphs", pytest.param("cuda", marks=pytest.mark.gpu),
                                   pytest.param("cuda-graphs", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("order", ["adapter first", "accelerate first"])
@pytest.mark.parametrize("name", list(TINY_INPUTS))
def test_lora_on_an_accelerated_model_is_stock(name, order, setup):
    C = importlib.import_module(f"bitfuse.models.{name}_configs")
    cuda = setup.startswith("cuda")
    model = C.build_model(C.tiny_config(), device="cuda", dtype=torch.bfloat16) if cuda \
        else C.build_model(C.tiny_config())
    stock, plain = copy.deepcopy(model), copy.deepcopy(model)  # plain: no adapter
    kwargs = C.make_inputs(model, **TINY_INPUTS[name])
    base = outputs(plain, kwargs)
    options = {}
    if setup.endswith("graphs"):
        options = dict(cuda_graphs=True, warmup=1)
        if not cuda:
            options["backend"] = graphs.EmulatedGraphBackend()

    def check(*, adapter_free: bool = False, call: dict = kwargs) -> None:
        for _ in range(2):  # (with graphs: the capture, then a replay)
            out = outputs(model, call)
            assert_all_same(out, outputs(stock, call))
            changed = any(not same_bits(o, b) for o, b in zip(out, base))
            assert changed is not adapter_free, "the adapters did not change the output" if not adapter_free \
                else "disabled adapters changed the output"

    if order == "adapter first":
        _add((model, stock), "a", 0)
    handle = bitfuse.accelerate(model, **options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", graphs.GraphCaptureWarning)  # (modules replaced are announced)
            if order == "accelerate first":
                _add((model, stock), "a", 0)
            check()
            _add((model, stock), "b", 1)
            for m in (model, stock):
                m.set_adapters(["a", "b"], weights=[0.5, 1.5])
            check()
            for m in (model, stock):
                m.set_adapters(["a", "b"], weights=[1.0, -0.25])  # new scales, the same modules
            check()
            # a per-call LoRA scale (diffusers' `apply_lora_scale`: the layers scaled for the call)
            params = inspect.signature(type(model).forward).parameters
            for key in ("joint_attention_kwargs", "attention_kwargs"):
                if key in params:
                    for scale in (0.3, 0.6):  # (with graphs: another value, another graph)
                        check(call={**kwargs, key: {"scale": scale}})
                    break
            for m in (model, stock):
                m.disable_adapters()
            check(adapter_free=True)
            for m in (model, stock):
                m.enable_adapters()
            check()
            for m in (model, stock):
                m.fuse_lora(lora_scale=0.75)  # the deltas merged into the base weights
            check()
            for m in (model, stock):
                m.unfuse_lora()
                m.delete_adapters("b")
            check()
        if setup.endswith("graphs"):  # graphs served the calls: captured per adapter state, replayed
            counts = handle.graphs.counts
            assert counts["eager"] == 0 and counts["replays"] > counts["captures"] >= 6, counts
    finally:
        handle.restore()
    assert is_stock(model)
    assert_all_same(outputs(model, kwargs), outputs(stock, kwargs))
