"""One fake run of a cell (or a function): its peak on the metered device, by kind and by line, without
running it for real.

The run enters torch's FakeTensorMode (`allow_non_fake_inputs=True`: the real tensors the cell reads, a
batch from a DataLoader, are turned into fakes as they are used, never written) and above it the fake
device (`fakerun/fake_device.py`), which counts every op's fresh outputs. The namespace's modules and
optimizers are replaced by fake copies for the run (`fakerun/fakes.py`). What the cell does is undone
afterwards by the caller (`fakerun/planner.py`).

Where it cannot go on:
- `.item()`, `float(t)`, `bool(t)` (aten._local_scalar_dense, which FakeTensorMode refuses:
  DataDependentOutputException in torch/_subclasses/fake_impls.py, 2.2 to 2.13) give the value where it
  is known: a fake tensor made from a Python number keeps it as `.constant` and FakeTensorMode carries it
  through in-place arithmetic (an optimizer's fresh step counter, `torch.tensor(0.0)` then `+= 1`), and a
  fake copy's value is its real tensor's (a copied optimizer's step count), and a uniform fake's is its one
  value (`fakerun/uniform.py`: what ends transformers' generate at its maximum length); elsewhere a stand-in value
  (0.0 for a float, so that a gradient scaler's found-inf check lets the step run; 1 for an int; False
  for a bool), so that logging and checks go on; the lines that took one are named;
- an op whose output's size depends on the data (nonzero, masked_select, unique, boolean indexing:
  DynamicOutputShapeException), reading a fake tensor's data (`.numpy()`, `.tolist()` past the stand-in),
  or any other error stops the run: the line that stopped it is named, and the figure covers the cell up
  to there.
A loop of training steps stops after the second optimizer step, and a loop at the cell's top level after
its second iteration (the peak repeats once the optimizer state exists): the result says so.
"""
from __future__ import annotations

import ast
import sys
import time
from dataclasses import dataclass, field

from cuda_magic.fakerun.fake_device import GRADIENTS, PARAMETERS
from cuda_magic.paths import is_library_file

LOOP_TICK = "_cuda_magic_predict_loop"     # the name the cell's top-level loops call (bound for the run)
STEPS = 2                                  # optimizer steps, or top-level loop iterations, then stop


MAX_STAND_INS = 1000                       # stand-in values in one run: past this, a loop ends on data
MAX_SECONDS = 120.0                        # one fake run at most


class Endless(BaseException):
    """Raised when a fake run seems not to end: a loop whose end is a tensor's value (generate's
    `unfinished_sequences.max() == 0` where no length limit makes it uniform) sees only stand-ins, or the
    run takes too long."""


class Enough(BaseException):
    """Raised inside the fake run once its steps repeat: a BaseException, so that the cell's own
    `except Exception` does not swallow it."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


@dataclass
class Stop:
    """Where a fake run could not go on: the cell's line, the innermost user line, and why."""

    line: int | None
    code: str
    where: str
    reason: str
    endless: bool = False


@dataclass
class FakeResult:
    value: int | None
    peak: int                            # predicted peak on the device, bytes (the fixed part included)
    start: int                           # what the device holds before the cell (predicted: now)
    by_kind: dict[str, int]
    recorder: object                     # the black box's Recorder of the fake run
    seconds: float
    stop: Stop | None = None             # the run did not reach the end of the cell
    enough: str | None = None            # it stopped on purpose: its steps repeat
    stand_ins: list[str] = field(default_factory=list)    # lines where .item() took a stand-in
    notes: list[str] = field(default_factory=list)
    reserved: int = 0                    # the peak of what the allocator reserved (the caching model's)
    runs_out: tuple | None = None        # (requested, allocated, reserved): the first request that could
                                         # not be reserved within the capacity

    @property
    def complete(self) -> bool:
        return self.stop is None

    def fits(self, capacity) -> bool:
        if self.runs_out is not None:
            return False
        return capacity is None or self.peak <= capacity     # (what is reserved is given back at the limit)


def add_loop_ticks(tree: ast.Module) -> ast.Module:
    """Each loop at the cell's top level calls LOOP_TICK(n) first in its body (n: which loop)."""
    for n, node in enumerate(tree.body):
        if isinstance(node, (ast.For, ast.While, ast.AsyncFor)):
            call = ast.Expr(ast.Call(ast.Name(LOOP_TICK, ast.Load()), [ast.Constant(n)], []))
            ast.copy_location(call, node.body[0])
            ast.fix_missing_locations(call)
            node.body.insert(0, call)
    return tree


class _LoopTicks:
    def __init__(self):
        self.counts: dict[int, int] = {}

    def __call__(self, n: int) -> None:
        count = self.counts[n] = self.counts.get(n, 0) + 1
        if count > STEPS:
            raise Enough(f"after {STEPS} iterations of the cell's loop")


_RUN_MODE = None


def _cublas_workspace(device, template) -> int:
    """Bytes of one cuBLAS workspace on the device predicted: CUDA's for its compute capability (where
    torch can say it), a simulated device's own `cublas_workspace` (0: none, its default)."""
    if template is not None:
        return int(getattr(template, "cublas_workspace", 0) or 0)
    if getattr(device, "type", None) != "cuda" or getattr(__import__("torch").version, "hip", None):
        return 0
    import torch

    from cuda_magic.devices.allocator_conf import installed_torch_version
    from cuda_magic.devices.probe import cuda_started
    from cuda_magic.fakerun.cuda_autocast import cublas_workspace_size

    if not cuda_started():
        return 0                       # the capability needs CUDA started; nothing is guessed
    capability = torch.cuda.get_device_capability(device.index or 0)
    return cublas_workspace_size(tuple(capability), installed_torch_version() or (2, 13))


def _run_mode_class():
    """The one dispatch mode of a fake run, above torch's FakeTensorMode: the fake device's count
    (devices/simulated.py's mode, whose dispatch it extends) and the stand-in values, in one layer (each
    Python mode layer costs every op of the run a trip through the dispatcher)."""
    global _RUN_MODE
    if _RUN_MODE is not None:
        return _RUN_MODE
    import torch

    from torch.utils._python_dispatch import _disable_current_modes as disabled

    from cuda_magic.devices.op_metadata import op_facts
    from cuda_magic.devices.simulated import counting_mode_class

    from torch._subclasses.fake_tensor import FakeTensor as fake_type

    from cuda_magic.fakerun.uniform import Uniform

    local_scalar = torch.ops.aten._local_scalar_dense.default
    device_of = torch.ops.prim.device.default
    cpu = torch.device("cpu")
    index_ops = tuple(getattr(torch.ops.aten.randperm, name) for name in ("default", "generator")
                      if hasattr(torch.ops.aten.randperm, name))     # (OpOverload hashes in Python: `is`)

    counting = counting_mode_class()
    count_dispatch = counting.__torch_dispatch__
    aten = torch.ops.aten
    matmuls = frozenset(getattr(aten, name) for name in ("mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv",
                                                          "addr", "_addmm_activation") if hasattr(aten, name))
    current_node = torch._C._current_autograd_node

    class RunMode(counting):
        """Counts every op's fresh outputs on the fake device; `.item()` on a fake tensor gives a stand-in
        value (and the line is noted)."""

        def __init__(self, device, cell_filename, real_of, cache=None):
            super().__init__(device)
            self.cache = cache                # fakerun/op_cache.py: repeated ops skip FakeTensorMode
            self.cell_filename = cell_filename
            self.real_of = real_of            # id(fake copy of a one-element tensor) -> its real value
            self.lines: list[str] = []
            self.count = 0
            self.deadline = time.perf_counter() + MAX_SECONDS
            self.uniform = Uniform()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is device_of and isinstance(args[0], fake_type):
                # a fake tensor's device asked from C++ (autograd, TensorIterator: a third of the calls of a
                # training step): what FakeTensorMode answers (its `_device_handler`, torch 2.2 to 2.13: the
                # `device` property), without the trip through both modes
                return args[0].device
            if (func is index_ops[0] or func is index_ops[-1]) and (kwargs or {}).get("device") in (None, cpu):
                with disabled():                  # a sampler's order (DataLoader(shuffle=True)): real, in
                    return func(*args, **(kwargs or {}))   # host memory, so that its .tolist() is real
            if func is local_scalar and not isinstance(args[0], fake_type):
                with disabled():
                    return args[0].item()
            if func is local_scalar:
                self.count += 1
                if self.count > MAX_STAND_INS or time.perf_counter() > self.deadline:
                    raise Endless(f"it took {self.count} stand-in values for `.item()`: a loop that ends on a "
                                  "tensor's value (a check for finished sequences with no length limit) cannot end on "
                                  "fake tensors" if self.count > MAX_STAND_INS else
                                  f"it ran past {MAX_SECONDS:.0f} s")
                if id(args[0]) in self.real_of:       # a fake copy: its real tensor's value
                    return self.real_of[id(args[0])]
                known = self.uniform.value(args[0])
                if known is not None:                 # one value everywhere (fakerun/uniform.py)
                    self.count -= 1
                    return known
                known = getattr(args[0], "constant", None)
                if known is not None and not getattr(known, "is_meta", True):
                    with disabled():                  # read outside the fake mode, which would fake it
                        return known.item()
                dtype = args[0].dtype
                where = _user_line(sys._getframe(1), self.cell_filename)
                if where not in self.lines:
                    self.lines.append(where)
                if dtype is torch.bool:
                    return False
                return 0.0 if (dtype.is_floating_point or dtype.is_complex) else 1
            if self.device.workspaces_pending and func.overloadpacket in matmuls:
                # cuBLAS's workspace, at a thread's first matrix product: the cell's thread, and
                # autograd's device thread in a backward pass (fakerun/cuda_autocast.py)
                self.device.take_workspace("backward" if current_node() is not None else "forward")
            cache = self.cache
            if cache is not None and cache.writes_first(func):
                key = cache.in_place_key(func, args, kwargs)
                if key is not None and cache.ran_in_place(key):
                    out = args[0] if op_facts(func).fresh else None   # (one entry per return)
                else:
                    out = count_dispatch(self, func, types, args, kwargs)
                    if key is not None:
                        cache.remember_in_place(key, args, out)
                self.uniform.after(func, args, kwargs, out)
                return out
            key = cache.key(func, args, kwargs) if cache is not None and cache.keeps(func) else None
            if key is not None:
                out = cache.outputs(key, args)
                if out is not None:
                    facts = op_facts(func)      # a view op's returns are not fresh: nothing to count, as in
                    if facts.any_fresh:         # its dispatch
                        self.device.track_outputs(out, facts.fresh, False)
                    self.uniform.after(func, args, kwargs, out)
                    return out
            out = count_dispatch(self, func, types, args, kwargs)
            if key is not None:
                cache.remember(key, args, kwargs, out)
            self.uniform.after(func, args, kwargs, out)
            return out

    _RUN_MODE = RunMode
    return RunMode


def _user_line(frame, cell_filename) -> str:
    """'line N' of the cell (or 'file:line' of the innermost user code) running in `frame` or a caller."""
    inner = None
    f = frame
    while f is not None:
        filename = f.f_code.co_filename
        if cell_filename is not None and filename == cell_filename:
            return f"line {f.f_lineno}"
        if inner is None and not is_library_file(filename) and "cuda_magic" not in filename:
            inner = f"{filename}:{f.f_lineno}"
        f = f.f_back
    return inner or "?"


def stop_of(exc: BaseException, cell_filename: str | None, lines) -> Stop:
    """Where in the cell (and in the user's code) an error stopped the fake run, and why, in words."""
    cell_line, where = None, ""
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if cell_filename is not None and filename == cell_filename:
            cell_line = tb.tb_lineno
        elif not is_library_file(filename) and "cuda_magic" not in filename:
            where = f"{filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    code = ""
    if cell_line is not None and lines and 0 < cell_line <= len(lines):
        code = lines[cell_line - 1].strip()
    return Stop(cell_line, code, where, _reason(exc), isinstance(exc, Endless))


def _reason(exc: BaseException) -> str:
    name = type(exc).__name__
    if isinstance(exc, Endless):
        return str(exc)
    if name == "DynamicOutputShapeException":
        op = str(exc.args[0]) if exc.args else "an op"
        return f"{op.split('.')[-2] if op.count('.') >= 2 else op}: its output's size depends on the data"
    if name == "DataDependentOutputException":
        return "it reads the data of a tensor, which a fake tensor does not have"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if "data pointer" in text or "Cannot access data" in text or "numpy" in text.lower():
        return f"it reads a tensor's data ({name}: {text[:120]})"
    return f"{name}: {text[:160]}" if text else name


class FakeRunner:
    """Runs `call()` once on fake tensors, metered as the meter would: `run(value)` -> FakeResult. items:
    ((index, name), value) to copy; the copy of each is bound as `binds[index][name]` (the namespace, a
    function's arguments or globals): the caller undoes that.

    device: the torch.device the meter counts; key: its key; real_allocated(): what it holds now;
    counts(tensor): whether the meter counts that real tensor's storage; autocast(): the
    context of --amp."""

    def __init__(self, call, *, device, key, real_allocated: int, counts, items, binds, autocast=None,
                 cell_filename=None, lines=None, capacity=None, allocator="plain", conf=None, template=None):
        self.call, self.device, self.key = call, device, key
        self.real_allocated, self.counts = real_allocated, counts
        self.items, self.binds = items, binds
        self.autocast = autocast
        self.cell_filename, self.lines = cell_filename, lines
        self.capacity, self.allocator, self.conf = capacity, allocator, conf
        self.template = template          # the simulated device metered: its allocator is copied

    def run(self, value=None) -> FakeResult:
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        from cuda_magic.devices.recorder import Recorder
        from cuda_magic.fakerun.fake_device import FakeDevice, KindTally
        from cuda_magic.fakerun.fakes import FakeCopies
        from cuda_magic.fakerun.op_cache import OpCache

        t0 = time.perf_counter()
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        copies = FakeCopies(self.items, fake_mode)
        fixed = max(0, self.real_allocated - copies.real_bytes(self.counts))
        device = FakeDevice(self.device, key=self.key, fixed=fixed, capacity=self.capacity,
                            allocator=self.allocator, conf=self.conf, template=self.template)
        device.set_workspace(_cublas_workspace(self.device, self.template))
        tally = KindTally()
        copies.hold(device, self.counts)
        device.start_peaks()
        start = device.allocated
        recorder = Recorder(cell_filename=self.cell_filename)
        device.attach_recorder(tally)
        device.attach_recorder(recorder)
        copies.label(tally)
        for (index, name), fake in copies.copies.items():
            self.binds[index][name] = fake
        self.binds[0][LOOP_TICK] = _LoopTicks()
        hooks = _Hooks(tally, copies)
        mode_class = _run_mode_class()
        cache = OpCache(fake_mode)
        device.mode_factory = lambda d: mode_class(d, self.cell_filename, copies.values, cache)
        stop = enough = None
        try:
            with hooks, fake_mode, device, self.autocast():
                stand_ins = device.counting_mode
                try:
                    self.call()
                except Enough as done:
                    enough = done.why
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:      # noqa: BLE001 - any error ends the fake run: said below
                    stop = stop_of(exc, self.cell_filename, self.lines)
                    exc.__traceback__ = None
                    del exc
            enough = enough or hooks.enough
        finally:
            device.detach_recorder(recorder)
            device.detach_recorder(tally)
        built = [v for m in self.binds for v in list(m.values()) if isinstance(v, torch.nn.Module)]
        for module in [*copies.modules(), *built]:   # a model the cell built: its parameters; gradients
            for p in module.parameters():             # kept (zero_grad(set_to_none=False))
                tally.label_tensor(p, PARAMETERS)
                if p.grad is not None:
                    tally.label_tensor(p.grad, GRADIENTS)
        notes = list(copies.notes)
        result = FakeResult(value, device.peak, start, tally.peak_by_kind(), recorder,
                            time.perf_counter() - t0, stop, enough, list(stand_ins.lines), notes,
                            reserved=device.peak_reserved, runs_out=device.runs_out)
        device.forget()
        return result


class _Hooks:
    """While a fake run goes: optimizer steps and module calls are followed (the kind of what they make),
    gradients are labelled as autograd accumulates them, and the run ends after the second step.

    An optimizer picks its implementation as it would for the real parameters: torch/optim/optimizer.py's
    `_default_to_fused_or_foreach` (2.2 to 2.13; every optimizer with a `foreach` option calls it when the
    user chose none) takes the foreach kernels only for tensors whose `type(p)` is in the module's list
    `_foreach_supported_types` (Tensor, Parameter) and whose device is one of
    `_get_foreach_kernels_supported_devices()` (cuda, xpu, the privateuse1 backend; never the CPU). A fake
    copy's type is FakeTensor, so without FakeTensor in that list every fake run would take the
    one-tensor-at-a-time path where a GPU takes foreach, whose `_foreach_sqrt` and friends make a whole
    set of parameter-sized temporaries at once: a low figure for every training cell on a GPU. With it the
    choice follows the fake tensor's device, the real one's: foreach on CUDA, as before on the CPU (the
    simulated device)."""

    def __init__(self, tally, copies):
        self.tally, self.copies = tally, copies
        self.handles = []
        self.foreach_types = None
        self.steps: dict[int, int] = {}
        self.enough = None

    def __enter__(self):
        import torch
        from torch.nn.modules import module as module_hooks
        from torch.optim import optimizer as optimizer_hooks

        tally = self.tally

        def step_pre(opt, args, kwargs):
            tally.in_step += 1
            for group in opt.param_groups:        # the gradients the step reads are gradients
                for p in group["params"]:
                    if p.grad is not None:
                        tally.label_tensor(p.grad, GRADIENTS)

        def step_post(opt, args, kwargs):
            tally.in_step = max(0, tally.in_step - 1)
            count = self.steps[id(opt)] = self.steps.get(id(opt), 0) + 1
            if count >= STEPS:
                self.enough = f"after {STEPS} optimizer steps"
                raise Enough(self.enough)

        def forward_pre(module, args):
            tally.in_module += 1

        def forward_post(module, args, output):
            tally.in_module = max(0, tally.in_module - 1)

        def accumulated(p):
            if p.grad is not None:
                tally.label_tensor(p.grad, GRADIENTS)

        self.handles = [optimizer_hooks.register_optimizer_step_pre_hook(step_pre),
                        optimizer_hooks.register_optimizer_step_post_hook(step_post),
                        module_hooks.register_module_forward_pre_hook(forward_pre),
                        module_hooks.register_module_forward_hook(forward_post)]
        for module in self.copies.modules():
            for p in module.parameters():
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(accumulated))
        from torch._subclasses.fake_tensor import FakeTensor

        types = getattr(optimizer_hooks, "_foreach_supported_types", None)
        if isinstance(types, list) and FakeTensor not in types:
            types.append(FakeTensor)
            self.foreach_types = types
        del torch
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.foreach_types is not None:
            from torch._subclasses.fake_tensor import FakeTensor

            while FakeTensor in self.foreach_types:
                self.foreach_types.remove(FakeTensor)
            self.foreach_types = None
        self.tally.in_step = self.tally.in_module = 0
        return False
