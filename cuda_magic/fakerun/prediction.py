"""The prediction's record: what `%%oomguard --predict` shows and `-o` returns. Sizes are int bytes."""
from __future__ import annotations

from dataclasses import dataclass, field

from cuda_magic.memory.blackbox import BlackBox
from cuda_magic.reprs import Rendered


@dataclass
class Run:
    """One fake run: the value it ran at, its predicted peak, whether it reached the end of the cell."""

    value: int | None
    peak: int
    complete: bool
    seconds: float
    accumulation: int | None = None

    def fits(self, capacity: int | None) -> bool | None:
        return None if capacity is None else self.peak <= capacity


@dataclass(repr=False)
class Prediction(Rendered):
    """A cell's predicted memory on the metered device, before running it.

    `.peak`: the predicted peak (what the device holds now included); `.by_kind`: that peak split into
    parameters, gradients, optimizer state, activations and the rest; `.by_line`: a DataFrame of what was
    alive at the peak by line (the black box of the fake run); `.largest`: with -r, the largest value
    that fits with the retry's margin (None where none was asked or none fits)."""

    _html_repr = False
    device: str = ""                       # the metered device's key
    device_name: str = ""
    capacity: int | None = None            # what the peak is compared against: the -l cap or the capacity
    limited: bool = False                  # capacity is a -l cap
    start: int = 0                         # what the device holds before the cell
    peak: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    blackbox: BlackBox | None = None
    complete: bool = True                  # the fake run reached the end of the cell (or its steps repeated)
    stop_line: int | None = None           # where it could not go on: the cell's line, its code, the
    stop_code: str = ""                    # innermost user line, and why
    stop_where: str = ""
    stop_reason: str = ""
    endless: bool = False                  # it stopped in a loop that never ends on fakes: its figure is
                                           # what it reached, neither a bound above nor below
    enough: str | None = None              # it stopped on purpose once its steps repeated: after what
    stand_ins: list[str] = field(default_factory=list)   # lines where .item() took a stand-in value
    variable: str | None = None
    accumulate: str | None = None
    value: int | None = None               # VAR's value now: the run the figures are of
    accumulation: int | None = None
    largest: int | None = None             # with -r: the largest value that fits, with the retry's margin
    largest_accumulation: int | None = None
    largest_peak: int | None = None
    independent: bool = False              # the peak does not change with VAR
    runs: list[Run] = field(default_factory=list)
    amp: str | None = None
    allocator: str = ""                    # what the figures count: 'tensors' bytes' or the caching allocator
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    api: bool = False
    reserved: int = 0                      # predicted peak of what the allocator reserves
    runs_out: tuple | None = None          # (requested, allocated, reserved) of the first request that the
                                           # allocator could not reserve within the capacity

    @property
    def fits(self) -> bool | None:
        """Whether the cell at its value now fits (None: no capacity to compare with, or the run stopped
        before the end and what it reached fits: not known)."""
        if self.endless:
            return None
        if self.runs_out is not None:
            return False
        if self.capacity is None:
            return None
        if self.peak > self.capacity:
            return False
        return True if self.complete else None

    @property
    def headroom(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.peak

    @property
    def by_line(self):
        """DataFrame: file, line, code, bytes, tensors alive at the predicted peak, largest first."""
        return self.blackbox.by_line_frame() if self.blackbox is not None else None

    def __str__(self) -> str:
        from cuda_magic.reprs import render

        return render(self, "text")

    def __repr__(self) -> str:
        """One line (as a cell's value with `-o`: the prediction has been shown); print() shows it all."""
        return self.line()

    def _repr_pretty_(self, p, cycle):
        p.text(self.line())

    def line(self) -> str:
        from cuda_magic.units import format_bytes

        fits = {True: "fits", False: "does not fit", None: "not known whether it fits"}[self.fits]
        against = f" of {format_bytes(self.capacity)}" if self.capacity is not None else ""
        largest = f"; largest {self.variable} {self.largest}" if self.largest is not None else ""
        return f"<Prediction {self.device}: peak {format_bytes(self.peak)}{against}, {fits}{largest}>"
