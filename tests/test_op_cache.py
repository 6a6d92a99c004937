"""fakerun/op_cache.py: a fake run's repeated ops skip FakeTensorMode, and what they make is what
FakeTensorMode makes (the same peak, by kind and by line, with the cache and without it)."""
from __future__ import annotations

import pytest

from conftest import run_ok
from test_predict import MLP, STEP, predict

ATTENTION = """
torch.manual_seed(0)
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.qkv = torch.nn.Linear(64, 192)
        self.out = torch.nn.Linear(64, 64)
    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a)
model = torch.nn.Sequential(torch.nn.Embedding(512, 64), Block(), Block(), torch.nn.Linear(64, 512))
opt = torch.optim.AdamW(model.parameters(), foreach=True)
"""
ATTENTION_STEP = """for step in range(3):
    ids = torch.randint(0, 512, (bs, 32))
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad()
"""


@pytest.mark.parametrize("setup,cell", [(MLP + "bs = 512", STEP), (ATTENTION + "bs = 24", ATTENTION_STEP)],
                         ids=["mlp", "attention"])
def test_the_cache_changes_no_figure_of_a_prediction(tip, monkeypatch, setup, cell):
    from cuda_magic.fakerun import op_cache

    run_ok(tip, "%gpumem --simulate 64MiB")
    run_ok(tip, setup)
    served = []
    outputs = op_cache.OpCache.outputs

    def counting(self, key, args=()):
        out = outputs(self, key, args)
        if out is not None:
            served.append(key[0])
        return out

    monkeypatch.setattr(op_cache.OpCache, "outputs", counting)
    cached = predict(tip, "", cell)
    again = predict(tip, "", cell)            # the first run's entries serve the second
    assert len(served) > 50, "the repeated steps' ops should come from the cache"
    monkeypatch.setattr(op_cache.OpCache, "keeps", lambda self, func: False)
    plain = predict(tip, "", cell)
    assert cached.complete and plain.complete
    assert cached.peak == plain.peak == again.peak
    assert cached.reserved == plain.reserved
    assert cached.by_kind == plain.by_kind
    columns = [c for c in plain.by_line.columns if "second" not in c]
    assert cached.by_line[columns].equals(plain.by_line[columns])


@pytest.fixture
def mode_and_cache():
    """A FakeTensorMode and an OpCache on it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cuda_magic.fakerun.op_cache import OpCache

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode, OpCache(mode)


def test_views_are_kept_in_place_ops_random_ops_and_lifts_are_not(mode_and_cache):
    import torch

    _, cache = mode_and_cache
    aten = torch.ops.aten
    assert cache.keeps(aten.mm.default) and cache.keeps(aten._foreach_add.Scalar)
    assert cache.keeps(aten.view.default) and cache.keeps(aten.transpose.int)   # Tensor(a) -> Tensor(a)
    assert cache.keeps(aten.split.Tensor)                                        # -> Tensor(a)[]
    assert not cache.keeps(aten.add_.Tensor)            # writes its input
    assert not cache.keeps(aten.add.out)                # writes out=
    assert not cache.keeps(aten.transpose_.default)     # Tensor(a!): changes its input's metadata
    assert not cache.keeps(aten.randn.default)          # nondeterministic_seeded (tags.yaml)
    assert not cache.keeps(aten._local_scalar_dense.default)   # returns a number
    assert not cache.keeps(aten.lift_fresh.default)     # Tensor(a) -> Tensor(a), but a constant's lift


def test_a_view_is_made_again_on_its_inputs_storage_as_fake_tensor_mode_made_it(mode_and_cache):
    # torch/_subclasses/fake_tensor.py (2.3 to 2.13), _get_output_tensor_from_cache_entry: a cached
    # view is remade on the input's storage with the output's sizes, strides and offset (set_).
    import torch

    mode, cache = mode_and_cache
    aten = torch.ops.aten
    with mode:
        x = torch.empty(4, 8)
        other = torch.empty(4, 8)
    calls = [(aten._unsafe_view.default, (x, [8, 4])),      # schema says fresh; it shares x's storage
             (aten.slice.Tensor, (x, 1, 2, 6)),             # an offset and x's strides
             (aten.transpose.int, (x, 0, 1)),
             (aten.split.Tensor, (x, 3, 1))]                # several views, the last one narrower
    for func, args in calls:
        with mode:
            first = func(*args)
        key = cache.key(func, args, {})
        cache.remember(key, args, {}, first)
        again_args = (other, *args[1:])                     # same key: other has x's metadata
        assert cache.key(func, again_args, {}) == key
        made = cache.outputs(key, again_args)
        firsts = first if isinstance(first, (list, tuple)) else [first]
        mades = made if isinstance(made, (list, tuple)) else [made]
        assert type(made) is type(first) and len(mades) == len(firsts), func
        for m, f in zip(mades, firsts):
            assert type(m) is type(f) and m.device == f.device and m.dtype == f.dtype
            assert (m.shape, m.stride(), m.storage_offset()) == (f.shape, f.stride(), f.storage_offset())
            assert m.untyped_storage()._cdata == other.untyped_storage()._cdata, func
        with mode:
            plain = func(*again_args)
        plains = plain if isinstance(plain, (list, tuple)) else [plain]
        assert [p.stride() for p in plains] == [m.stride() for m in mades]


def test_a_fresh_output_gets_a_storage_of_its_own(mode_and_cache):
    import torch

    mode, cache = mode_and_cache
    w = torch.ops.aten.mm.default
    with mode:
        x = torch.empty(4, 8)
        args = (x, torch.empty(8, 2))
        z = w(*args)
        key = cache.key(w, args, {})
        cache.remember(key, args, {}, z)
        made = cache.outputs(key, args)
    assert made.shape == z.shape and made.stride() == z.stride() and made.device == z.device
    assert made.untyped_storage()._cdata != z.untyped_storage()._cdata
    assert made.untyped_storage()._cdata != x.untyped_storage()._cdata


def test_an_output_that_is_an_input_is_not_kept(mode_and_cache):
    import torch

    mode, cache = mode_and_cache
    func = torch.ops.aten.alias.default
    with mode:
        x = torch.empty(4, 8)
    key = cache.key(func, (x,), {})
    cache.remember(key, (x,), {}, x)        # an op that hands its input back (as a decomposition may)
    assert cache.outputs(key, (x,)) is None


def test_one_table_of_op_facts_read_from_the_schemas():
    """devices/op_metadata.py reads an op's schema once for the simulated device's count, the fake run and
    its op cache. Schemas from aten/src/ATen/native/native_functions.yaml (torch 2.2 to 2.13)."""
    import torch

    from cuda_magic.devices.op_metadata import call_key, op_facts

    aten = torch.ops.aten
    # view(Tensor(a) self, SymInt[] size) -> Tensor(a): makes nothing, a view of its first argument
    assert op_facts(aten.view.default)[:6] == ((False,), False, False, False, True, True)
    # mm(Tensor self, Tensor mat2) -> Tensor: one fresh storage
    assert op_facts(aten.mm.default)[:6] == ((True,), True, False, False, False, True)
    # zeros(SymInt[] size, *, ScalarType? dtype=None, ..., Device? device=None, ...) -> Tensor
    assert op_facts(aten.zeros.default).has_device
    # randn(...) -> Tensor, tagged nondeterministic_seeded: its outputs are not kept
    assert not op_facts(aten.randn.default).cacheable
    # lift_fresh(Tensor(a) self) -> Tensor(a); set_.source_Storage wraps a storage; set_.source_Tensor does not
    assert op_facts(aten.lift_fresh.default).lifted and op_facts(aten.set_.source_Storage).lifted
    assert not op_facts(aten.set_.source_Tensor).lifted and not op_facts(aten.lift_fresh.default).cacheable
    # add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!); _foreach_add_.Scalar
    # (Tensor(a!)[] self, Scalar scalar) -> (); resize_ changes metadata; add.out writes its out= argument
    assert op_facts(aten.add_.Tensor).writes_first and op_facts(aten._foreach_add_.Scalar).writes_first
    assert not op_facts(aten.resize_.default).writes_first and not op_facts(aten.add.out).writes_first
    assert op_facts(aten.mm.default) is op_facts(aten.mm.default)          # read once

    a, b = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64)
    assert call_key(aten.mm.default, (a, a.T), {}) == call_key(aten.mm.default, (a + 1, a.T), {})
    assert call_key(aten.add.Tensor, (a, a), {}) != call_key(aten.add.Tensor, (a, b), {})
    assert call_key(aten.add_.Scalar, (a, 0.1), {}) != call_key(aten.add_.Scalar, (a, 0.2), {})
    assert (call_key(aten.add_.Scalar, (a, 0.1), {}, floats_by_type=True)
            == call_key(aten.add_.Scalar, (a, 0.2), {}, floats_by_type=True))
    old = torch.get_default_dtype()
    key = call_key(aten.zeros.default, ([3],), {})
    torch.set_default_dtype(torch.float64)
    try:
        assert call_key(aten.zeros.default, ([3],), {}) != key                # the default dtype is in it
    finally:
        torch.set_default_dtype(old)
    with pytest.raises(TypeError):
        call_key(aten.mm.default, (a, a.T), {"unhashable": [{1, 2}]})
