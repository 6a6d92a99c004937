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

    def counting(self, key):
        out = outputs(self, key)
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


def test_views_in_place_ops_and_random_ops_are_not_kept():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cuda_magic.fakerun.op_cache import OpCache

    cache = OpCache(FakeTensorMode(allow_non_fake_inputs=True))
    aten = torch.ops.aten
    assert cache.keeps(aten.mm.default) and cache.keeps(aten._foreach_add.Scalar)
    assert not cache.keeps(aten.view.default)           # returns an alias of its input
    assert not cache.keeps(aten.add_.Tensor)            # writes its input
    assert not cache.keeps(aten.add.out)                # writes out=
    assert not cache.keeps(aten.randn.default)          # nondeterministic_seeded (tags.yaml)
    assert not cache.keeps(aten._local_scalar_dense.default)   # returns a number


def test_an_output_that_shares_an_inputs_storage_is_not_kept():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cuda_magic.fakerun.op_cache import OpCache

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cache = OpCache(mode)
    with mode:
        x = torch.empty(4, 8)
        y = torch.ops.aten._unsafe_view.default(x, [8, 4])    # schema says fresh; it shares x's storage
        z = torch.ops.aten.mm.default(x, torch.empty(8, 2))
    func = torch.ops.aten._unsafe_view.default
    key = cache.key(func, (x, [8, 4]), {})
    cache.remember(key, (x, [8, 4]), {}, y)
    assert cache.outputs(key) is None
    w = torch.ops.aten.mm.default
    args = (x, torch.empty(8, 2, device="meta"))
    with mode:
        args = (x, torch.empty(8, 2))
        key = cache.key(w, args, {})
        cache.remember(key, args, {}, z)
        made = cache.outputs(key)
    assert made.shape == z.shape and made.stride() == z.stride() and made.device == z.device
    assert made.untyped_storage()._cdata != z.untyped_storage()._cdata
