"""The black box around one guarded run, on whichever device the run is metered on: the simulated device
records inside its own accounting (blackbox.Recorder); CUDA through torch's allocator history
(cuda_history.CudaHistory); elsewhere nothing is recorded, with a one-line note."""
from __future__ import annotations

import sys

from cuda_magic.devices.recorder import DEFAULT_MAX_EVENTS, Recorder

NOTE_NO_DEVICE = ("no black box here: it records on the simulated device (`-l`, `%gpumem --simulate`) "
                  "and on CUDA")


class Recording:
    """`start()`, then `begin_attempt(n)` / `pause()` around each attempt, then `stop()` -> Recorder."""

    def __init__(self, meter, *, cell_filename: str | None = None, max_events: int = DEFAULT_MAX_EVENTS,
                 find_cell: bool = False):
        self.meter = meter
        self.cell_filename = cell_filename
        self.find_cell = find_cell          # the cell's file is found from the frames (`%oomguard on`)
        self.max_events = max_events
        self.recorder: Recorder | None = None
        self.history = None
        self.notes: list[str] = []

    def start(self) -> None:
        key = self.meter.key
        if key.startswith("sim"):
            self.recorder = Recorder(cell_filename=self.cell_filename, max_events=self.max_events,
                                     find_cell=self.find_cell)
            self.meter.device.attach_recorder(self.recorder)
        elif key.startswith("cuda") and "torch" in sys.modules:
            from cuda_magic.devices.cuda_history import CudaHistory

            self.history = CudaHistory(sys.modules["torch"], self.meter.index, cell_filename=self.cell_filename,
                                       find_cell=self.find_cell)
            if not self.history.start():
                self.notes.extend(self.history.notes)
                self.history = None
        else:
            self.notes.append(NOTE_NO_DEVICE)

    def begin_attempt(self, number: int) -> None:
        if self.recorder is not None:
            self.recorder.begin_attempt(number)
        elif self.history is not None:
            self.history.begin_attempt(number)

    def pause(self) -> None:
        """Between attempts: the alive set keeps following frees, no events are kept."""
        if self.recorder is not None:
            self.recorder.pause()
        elif self.history is not None:
            self.history.pause()

    def failed(self) -> None:
        """Called inside the `except` block of an OOM, before anything is freed."""
        if self.history is not None:
            self.history.failed()

    def stop(self) -> Recorder | None:
        if self.recorder is not None:
            self.meter.device.detach_recorder(self.recorder)
            return self.recorder
        if self.history is not None:
            recorder = self.history.stop()
            if recorder is None:
                self.notes.extend(self.history.notes)
            return recorder
        return None

    def discard(self) -> None:
        """Stop without reading anything (a run that fitted, under `%oomguard on`): on CUDA no snapshot is
        taken, which would cost the history's size."""
        if self.recorder is not None:
            self.meter.device.detach_recorder(self.recorder)
            self.recorder = None
        if self.history is not None:
            self.history.discard()
            self.history = None
