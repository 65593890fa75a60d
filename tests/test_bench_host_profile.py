"""bench/host_profile.py's host-time split on the CPU (a tiny Sana): which modules it
hooks, what it reports, and that it leaves the model as it found it."""

import pytest
import torch

pytest.importorskip("diffusers")

from bench import host_profile  # noqa: E402
from bitfuse.models.sana_configs import build_model, make_inputs, tiny_config  # noqa: E402


def test_the_split_hooks_only_non_leaf_children_and_adds_up():
    model = build_model(tiny_config(num_layers=3), seed=0)
    kwargs = make_inputs(model, batch=2, height=128, width=128)
    blocks = host_profile.blocks_of(model)
    assert len(blocks) == 3
    leaves = [m for b in blocks for m in b.modules() if not any(True for _ in m.children())]

    def call():
        # a hook on a norm or a convolution would turn its site off: none is hooked
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in leaves)
        with torch.no_grad():
            return model(**kwargs)

    split = host_profile.module_split(model, call, n=1)  # one sample: its parts add up to its total
    assert {"attn1", "attn2", "ff", "blocks, own code", "outside the blocks", "total"} <= set(split)
    assert all(v >= 0 for k, v in split.items() if k != "blocks, own code")
    parts = sum(v for k, v in split.items() if k != "total")
    assert parts == pytest.approx(split["total"], rel=1e-9)
    assert len(host_profile.module_split(model, call, n=3)) == len(split)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_model_without_blocks_is_refused():
    with pytest.raises(ValueError, match="no repeated blocks"):
        host_profile.module_split(torch.nn.Linear(2, 2), lambda: None)


def test_host_and_wall_times_each_forward_apart():
    """host: until the call returns; wall: until the sync returns as well (here a sync
    that takes 20 ms: a device still busy after the call); cpu: the thread's CPU time in
    the call (a call that sleeps 20 ms takes almost none, one that computes takes its
    host time)."""
    import time

    calls, syncs = [], []
    host, wall, cpu = host_profile.host_and_wall(lambda: calls.append(1), n=3, warmup=2,
                                                 sync=lambda: (syncs.append(1), time.sleep(0.02)))
    assert len(calls) == 5 and len(syncs) == 4  # one sync after the warm-up, one a timed forward
    assert len(host) == len(wall) == len(cpu) == 3
    assert all(h < 5 and w >= h + 19 and c <= h + 1 for h, w, c in zip(host, wall, cpu))

    def busy():
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass

    host, wall, cpu = host_profile.host_and_wall(lambda: time.sleep(0.02), n=2, warmup=0, sync=lambda: None)
    assert all(h >= 19 and c < 5 for h, c in zip(host, cpu))  # waiting, not computing
    host, wall, cpu = host_profile.host_and_wall(busy, n=2, warmup=0, sync=lambda: None)
    assert all(c >= 19 and h >= c - 1 for h, c in zip(host, cpu))  # computing: its CPU time is its host time
