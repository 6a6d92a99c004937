"""fakerun/uniform.py: which fake tensors hold one known value everywhere, followed through the ops of a
fake run (torch's FakeTensorMode, torch/_subclasses/fake_tensor.py, 2.2.2 and 2.13; ops reach a
TorchDispatchMode above it as aten overloads, `torch.Tag.pointwise` marking the pointwise ones)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def fake():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from cuda_magic.fakerun.uniform import Uniform

    class Follow(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.uniform = Uniform()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.uniform.after(func, args, kwargs, out)
            return out

    follow = Follow()
    with FakeTensorMode(allow_non_fake_inputs=True), follow:
        yield follow.uniform.value


def test_made_from_one_number(fake):
    assert fake(torch.full((4,), True)) is True
    assert fake(torch.ones(3, dtype=torch.long)) == 1
    assert fake(torch.zeros(2, 2)) == 0.0
    x = torch.empty(5)
    assert fake(x) is None
    x.fill_(7.5)
    assert fake(x) == 7.5
    assert fake(torch.ones(3).new_full((2,), 3)) == 3.0


def test_random_and_data_are_not_known(fake):
    assert fake(torch.randn(4)) is None
    assert fake(torch.randn(4) + torch.ones(4)) is None
    assert fake(torch.randint(0, 5, (3,)).max()) is None


def test_pointwise_of_uniforms_is_computed_with_its_dtype(fake):
    a = torch.ones(3, dtype=torch.long)
    assert fake(a + 2) == 3 and isinstance(fake(a + 2), int)
    assert fake(a * 0.5) == 0.5
    assert fake(~torch.full((3,), True)) is False
    assert fake((a - 1) == 0) is True
    assert fake(a >= 2) is False


def test_absorbing_inputs_decide_the_result(fake):
    unknown = torch.randint(0, 2, (4,)).bool()
    assert fake(unknown | torch.full((4,), True)) is True
    assert fake(unknown & torch.full((4,), False)) is False
    assert fake(torch.ones(4, dtype=torch.long) & ~torch.full((4,), True)) == 0
    assert fake(torch.randint(0, 9, (4,)) * 0) == 0
    assert fake(torch.randn(4) * 0) is None          # NaN * 0 is NaN: not known on floats
    assert fake(unknown | torch.full((4,), False)) is None


def test_reductions_and_views(fake):
    u = torch.full((2, 3), 4)
    assert fake(u.max()) == 4 and fake(u.amin(dim=1)) == 4 and fake(u.all()) is True
    assert fake(u[:, 1]) == 4 and fake(u.view(6)) == 4 and fake(u.t().float()) == 4.0
    assert fake(u.sum()) is None                     # sum is not followed


def test_an_in_place_write_through_a_view_makes_the_base_unknown(fake):
    base = torch.zeros(4)
    view = base[:2]
    view.add_(1)                       # the version counter, shared by views, moves (ADInplaceOrView)
    assert fake(view) == 1.0
    assert fake(base) is None
    base.zero_()
    assert fake(base) == 0.0 and fake(view) is None


def test_the_generate_stop_check_ends_at_max_length(fake):
    """transformers generation/utils.py `_sample` (4.57.6, 5.24.0): `unfinished & ~criteria`, then
    `unfinished.max() == 0`; criteria = `full(False) | eos_hit | full(cur_len >= max_length)`
    (generation/stopping_criteria.py StoppingCriteriaList and MaxLengthCriteria)."""
    unfinished = torch.ones(3, dtype=torch.long)
    for is_done in (False, True):
        eos = torch.isin(torch.randint(0, 9, (3, 1)), torch.tensor([2])).any(dim=-1)
        criteria = torch.full((3,), False) | eos | torch.full((3,), is_done)
        unfinished = unfinished & ~criteria
        finished = unfinished.max() == 0
        assert fake(finished) is (True if is_done else None)
