"""What the extension turned on in one shell, kept on its Magics objects so that it lives and dies with
them: `%load_ext` makes one ExtensionState and gives it to the three Magics objects it registers; unload
stops exactly what this shell started (its watcher, `%oomguard on`, its simulated device, its live gauge)."""
from __future__ import annotations


class ExtensionState:
    def __init__(self, shell):
        self.shell = shell
        self.magics: list = []              # the Magics objects registered, each holding this state
        self.watcher = None                 # watch.CellWatcher from the first --watch on (kept after --unwatch)
        self.last_snapshot = None           # for --diff
        self.guard_all = None               # guard_all.GuardAll while `%oomguard on`
        self.simulated = None               # the SimulatedDevice `%gpumem --simulate` started here
        self.live = None                    # display.gauge.LiveGauge while `%gpumem --live` is on
        self.last_report = None             # the last guarded cell's GuardReport, for `%oomguard last`
        self.last_prediction = None         # the last `%%oomguard --predict` cell's Prediction

    @property
    def history(self) -> list:
        """The --watch records (the watcher owns them)."""
        return self.watcher.records if self.watcher is not None else []

    def start_simulated(self, capacity: int):
        """This shell's simulated device, replacing the one it had on."""
        from cuda_magic.devices.simulated import SimulatedDevice

        self.stop_simulated()
        self.simulated = SimulatedDevice(capacity).start()
        return self.simulated

    def stop_simulated(self) -> bool:
        """Switch this shell's simulated device off for good; whether one was on."""
        dev, self.simulated = self.simulated, None
        if dev is None:
            return False
        dev.stop()
        dev.forget()
        return True

    def stop_live(self) -> None:
        """Stop the `%gpumem --live` gauge and join its thread, leaving its last reading shown."""
        live, self.live = self.live, None
        if live is not None:
            live.stop(hide=False)

    def stop_all(self) -> None:
        self.stop_live()
        if self.watcher is not None:
            self.watcher.stop()
        if self.guard_all is not None:
            self.guard_all.stop()
            self.guard_all = None
        self.stop_simulated()


def get_state(shell) -> ExtensionState | None:
    """The state of cuda_magic in `shell`, found on the Magics objects it registered; None where the
    extension is not loaded."""
    manager = getattr(shell, "magics_manager", None)
    for instance in list(getattr(manager, "registry", {}).values()):
        state = getattr(instance, "cuda_magic_state", None)
        if isinstance(state, ExtensionState) and state.shell is shell:
            return state
    return None
