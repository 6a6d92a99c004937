"""What a cell already does, read from its source, so that advice does not suggest it again: gradient
checkpointing, autocast, no_grad / inference_mode, a backward pass, an optimizer step; the names it uses
(advice never suggests deleting them); and the settings of a framework's trainer on its stack (the
caller reads them: recover.trainers). Pure: text in, facts out."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass

_CHECKPOINT = re.compile(r"\bcheckpoint(_sequential)?\s*\(|gradient_checkpointing_enable\s*\(|"
                         r"gradient_checkpointing\s*=\s*True")
_AUTOCAST = re.compile(r"\bautocast\s*\(|\.half\s*\(|torch\.(b?float16)\b|dtype\s*=\s*torch\.(b?float16)\b")
_NO_GRAD = re.compile(r"\b(no_grad|inference_mode)\s*\(|@torch\.(no_grad|inference_mode)\b|\bset_grad_enabled\s*\(\s*False")
_BACKWARD = re.compile(r"\.backward\s*\(|autograd\.grad\s*\(|\bbackward\s*\(")
_STEP = re.compile(r"\.step\s*\(")
_GENERATE = re.compile(r"\.generate\s*\(")


@dataclass(frozen=True)
class TrainerSettings:
    """A transformers `Trainer` that ran the failing step, and what decides its memory: the batch it was
    made with (it reads its batch size when made), its accumulation, mixed precision, checkpointing."""

    batch: int | None = None              # the per-device train batch the Trainer runs
    accumulation: int = 1                 # gradient_accumulation_steps
    mixed: bool = False                   # bf16 or fp16
    checkpointing: bool = False           # gradient_checkpointing


@dataclass(frozen=True)
class CellReading:
    """What the source of the failing cell (and the functions it names) says it does already."""

    names: frozenset[str] = frozenset()   # the names it reads or binds
    checkpoints: bool = False             # gradient checkpointing
    autocasts: bool = False               # mixed precision (autocast, half, bfloat16)
    no_grad: bool = False                 # no_grad / inference_mode
    backward: bool = False                # a backward pass (loss.backward(), autograd.grad)
    steps: bool = False                   # an optimizer step
    generates: bool = False               # model.generate(...)
    trainer: TrainerSettings | None = None   # a transformers Trainer on the failing stack
    generate_call: str = ""               # the source of its first `.generate(...)` call's line
    new_tokens: int | None = None         # the max_new_tokens it asks `generate` for, where known
    new_tokens_name: str | None = None    # the name that holds it (`max_new_tokens=n`)

    @property
    def evaluates(self) -> bool:
        """A forward pass only, with graphs recorded: no backward pass, no step, no no_grad."""
        return not (self.backward or self.steps or self.no_grad)


def read_cell(source: str) -> CellReading:
    """The facts of a cell's source ('' gives none)."""
    text = source or ""
    call = next((line.strip() for line in text.splitlines() if _GENERATE.search(line)), "")
    tokens = _NEW_TOKENS.search(text)
    value = tokens.group(1) if tokens else None
    return CellReading(names=frozenset(names_in(text)), checkpoints=bool(_CHECKPOINT.search(text)),
                       autocasts=bool(_AUTOCAST.search(text)), no_grad=bool(_NO_GRAD.search(text)),
                       backward=bool(_BACKWARD.search(text)), steps=bool(_STEP.search(text)),
                       generates=bool(_GENERATE.search(text)), generate_call=call,
                       new_tokens=int(value) if value and value.isdigit() else None,
                       new_tokens_name=value if value and not value.isdigit() else None)


_NEW_TOKENS = re.compile(r"\bmax_new_tokens\s*=\s*([A-Za-z_]\w*|\d+)\b")
# keyword arguments that set how long something runs or how much it generates, not how many samples it
# holds at once: a name passed only there (or only to range()) is no batch to retry
_LENGTH_KEYWORDS = frozenset({"max_new_tokens", "min_new_tokens", "max_length", "min_length", "max_steps",
                              "num_train_epochs", "epochs", "steps", "num_steps", "iterations"})


def lengths_only(source: str) -> frozenset[str]:
    """The names the source reads only as a loop bound (`range(n)`) or a length keyword
    (`max_new_tokens=n`): sizes of a loop or a generation, not a batch that drives an allocation."""
    try:
        tree = ast.parse(source or "")
    except (SyntaxError, ValueError):
        return frozenset()
    as_length, elsewhere = set(), set()
    length_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "range":
                length_nodes.update(id(a) for a in node.args)
            length_nodes.update(id(k.value) for k in node.keywords if k.arg in _LENGTH_KEYWORDS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            (as_length if id(node) in length_nodes else elsewhere).add(node.id)
    return frozenset(as_length - elsewhere)


def names_in(source: str) -> set[str]:
    """Every name the source reads or binds (attribute roots included: `model.generate` -> model)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):      # magics inside a cell: the words still name things
        return set(re.findall(r"\b[A-Za-z_]\w*\b", source))
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def bound_before_read(source: str) -> frozenset[str]:
    """The names whose first use in the source, in the order Python runs it, binds them (`big =
    torch.empty(...)`, `out = model(x)`): the cell never reads the value they held before it ran.
    `big = big + 1` and `total += loss` read first."""
    try:
        tree = ast.parse(source or "")
    except (SyntaxError, ValueError):
        return frozenset()
    reading = _FirstUse()
    reading.visit(tree)
    return frozenset(n for n, bound in reading.first.items() if bound)


class _FirstUse(ast.NodeVisitor):
    """Whether each name is first bound or first read, visiting an assignment's value before its targets."""

    def __init__(self):
        self.first: dict[str, bool] = {}

    def visit_Name(self, node):
        self.first.setdefault(node.id, isinstance(node.ctx, ast.Store))

    def visit_Assign(self, node):
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.target)

    def visit_AugAssign(self, node):
        if isinstance(node.target, ast.Name):
            self.first.setdefault(node.target.id, False)
        self.visit(node.value)
        self.visit(node.target)

    def visit_NamedExpr(self, node):
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node):
        self.visit(node.iter)
        self.visit(node.target)
        for stmt in node.body + node.orelse:
            self.visit(stmt)

    visit_AsyncFor = visit_For


_BATCH_NAME = re.compile(r"(^|_)(bs|batch|batch_?size|micro_?batch|mbs|n_?batch)(_|$)|batch", re.I)
_ACCUM_NAME = re.compile(r"accum|grad_?acc|(^|_)acc(_|$)", re.I)
_SIZE_NAME = re.compile(r"(^|_)(n|num|size|len|length|seq|seq_?len|rows|samples|chunk)(_|$)", re.I)


def batch_names(ints: dict[str, int], failing_line: str = "", source: str = "") -> tuple[str | None, str | None]:
    """The cell's own names for its batch and its accumulation, from the integer names it reads
    (`ints`, name -> value): a name that says so (`batch_size`, `bs`; `accum_steps`, `grad_acc`), else
    for the batch one the failing line uses, else one that names a size; never one the cell's `source`
    reads only as a loop bound or a generation length (`range(n)`, `max_new_tokens=n`). None where none
    fits, so that advice is never pasted with a name the cell does not have."""
    usable = {n: v for n, v in ints.items() if type(v) is int and v >= 1 and not n.startswith("_")}
    accum = next((n for n in sorted(usable) if _ACCUM_NAME.search(n)), None)
    rest = [n for n in sorted(usable, key=lambda n: (-usable[n], n)) if n != accum and usable[n] >= 2]
    in_line = set(names_in(failing_line.strip())) if failing_line.strip() else set()
    lengths = lengths_only(source)
    for ok in (lambda n: bool(_BATCH_NAME.search(n)), lambda n: n in in_line and n not in lengths,
               lambda n: bool(_SIZE_NAME.search(n)) and n not in lengths):
        batch = next((n for n in rest if ok(n)), None)
        if batch is not None:
            return batch, accum
    return None, accum
