"""FastLaunch's direct call of Triton's C launcher: taken only when it is what the
launcher object's own `__call__` would do (CPU: fake launcher classes)."""

from bitfuse.ops import _pointwise
from bitfuse.ops._pointwise import _c_launch, next_pow2


def c_launch(*args):  # stands for the compiled C function
    return args


class Triton36Launcher:
    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False
    launch = staticmethod(c_launch)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = None
        profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


class OtherLauncher(Triton36Launcher):
    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, *args)  # another argument order


def test_direct_call_only_for_the_known_launcher_without_scratch():
    _pointwise._C_LAUNCH_OK.clear()
    assert _c_launch(Triton36Launcher()) is c_launch
    assert _c_launch(OtherLauncher()) is None
    with_scratch = Triton36Launcher()
    with_scratch.global_scratch_size = 128
    assert _c_launch(with_scratch) is None
    profiled = Triton36Launcher()
    profiled.profile_scratch_size = 64
    assert _c_launch(profiled) is None


def test_next_pow2_matches_the_definition():
    assert [next_pow2(n) for n in (1, 2, 3, 64, 65, 2240, 4096, 4097)] == [1, 2, 4, 64, 128, 4096, 4096, 8192]
