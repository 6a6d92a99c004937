"""offload(): tensors, modules, optimizers and containers moved with their data and identities kept.

Without a GPU the real move (GPU -> CPU) cannot happen, so the structure is checked by moving to the
'meta' device (every tensor visibly changes device) and the data by moving to the CPU; with CUDA the
real move is tested too.
"""
import collections

import pytest
import torch

from cuda_magic.recover.offload import offload


def trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(16, 4)).pow(2).mean().backward()
    opt.step()
    return model, opt


def devices_of(model, opt):
    found = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
    found |= {p.grad.device.type for p in model.parameters() if p.grad is not None}
    found |= {v.device.type for s in opt.state.values() for v in s.values() if v.dim() > 0}
    return found


def test_model_and_optimizer_move_keeping_identities():
    model, opt = trained()
    params = list(model.parameters())
    state_keys = list(opt.state.keys())
    pair = offload((opt, model), device="meta")  # the optimizer first: it is still done last
    assert pair[0] is opt and pair[1] is model
    assert devices_of(model, opt) == {"meta"}
    # CPU -> meta cannot keep a parameter's identity (GPU -> CPU does, see the CUDA test): the optimizer
    # follows the module's new parameters, with its state
    now = list(model.parameters())
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in now]
    assert set(map(id, opt.state.keys())) == set(map(id, now))
    assert len(state_keys) == len(now) == len(params)


def test_optimizer_alone_moves_only_its_state():
    model, opt = trained()
    offload(opt, device="meta")
    assert {p.device.type for p in model.parameters()} == {"cpu"}  # the model was not named
    assert {v.device.type for s in opt.state.values() for v in s.values() if v.dim() > 0} == {"meta"}


def test_step_still_works_after_offload_to_cpu():
    model, opt = trained()
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    moved = offload({"model": model, "opt": opt})
    assert moved["model"] is model and moved["opt"] is opt
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    for p, s in opt.state.items():
        assert all(torch.equal(v, state_before[id(p)][k]) for k, v in s.items())
    model(torch.randn(16, 4)).pow(2).mean().backward()
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_tensors_are_detached_and_leaves_keep_requires_grad():
    leaf = torch.randn(3, requires_grad=True)
    leaf.grad = torch.ones(3)
    derived = leaf * 2
    moved_leaf, moved_derived = offload([leaf, derived], device="meta")
    assert moved_leaf.device.type == "meta" and moved_leaf.requires_grad and moved_leaf.is_leaf
    assert moved_leaf.grad.device.type == "meta"
    assert moved_derived.grad_fn is None and not moved_derived.requires_grad
    data = torch.arange(6.0)
    moved = offload(data)
    assert torch.equal(moved, torch.arange(6.0))


def test_containers_keep_their_types_and_sharing():
    t = torch.ones(2)
    Pair = collections.namedtuple("Pair", "a b")
    lst = [t, 3, "s", t]
    dct = {"t": t, "n": 1}
    st = {t}
    obj = [lst, dct, (t, 1), Pair(t, 2), st, frozenset([t])]
    moved = offload(obj, device="meta")
    assert moved is obj and moved[0] is lst and moved[1] is dct and moved[4] is st
    assert lst[0].device.type == "meta" and lst[0] is lst[3]  # one tensor, moved once
    assert lst[1:3] == [3, "s"] and dct["n"] == 1
    assert type(moved[2]) is tuple and moved[2][0] is lst[0]
    assert type(moved[3]) is Pair and moved[3].a is lst[0] and moved[3].b == 2
    assert next(iter(st)) is lst[0]
    assert type(moved[5]) is frozenset and next(iter(moved[5])).device.type == "meta"


def test_self_referencing_list():
    lst = [torch.ones(1)]
    lst.append(lst)
    assert offload(lst, device="meta") is lst
    assert lst[0].device.type == "meta" and lst[1] is lst


def test_other_objects_are_returned_unchanged():
    class Box:
        pass

    box = Box()
    assert offload(box) is box and offload(5) == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_gpu_to_cpu():
    model, opt = trained()
    model.cuda()
    model(torch.randn(16, 4, device="cuda")).pow(2).mean().backward()
    opt.step()
    allocated = torch.cuda.memory_allocated()
    params = list(model.parameters())
    offload([model, opt])
    assert devices_of(model, opt) == {"cpu"}
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(p in opt.state for p in params)
    assert torch.cuda.memory_allocated() < allocated
    model(torch.randn(16, 4)).pow(2).mean().backward()
    opt.step()
