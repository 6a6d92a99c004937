"""What the user asked a guarded run or a prediction to do, checked in one place before anything acts.

`AskedOptions` holds the options as they were typed: a magic's flags (`%%oomguard -r bs -l 4GiB`) or the
API's keywords (`oomguard(retry="bs", limit="4GiB")`). Its checks raise `OptionError`, worded for the form
the user wrote (a magic's `-r VAR`, the API's `retry=`); the magics turn it into the one-line UsageError,
the API into ValueError (TypeError where the error says so). `check(values)` gives the meter and the
`GuardOptions` that both cores take (recover/guarded.py, fakerun/predicting.py); nothing is changed by
any check.

    asked = AskedOptions(retry="bs", limit="4GiB")
    asked.check_form()                    # what needs no values: at once (the API's decorator)
    meter, options = asked.check(values)  # with the values of the retried names: the meter chosen
"""
from __future__ import annotations

from dataclasses import dataclass

from cuda_magic.units import SizeError, is_positive_int, parse_limit


class OptionError(Exception):
    """An option the user gave cannot be used; the message says what to do. `kind`: the error the Python
    API raises for it (ValueError, or TypeError)."""

    def __init__(self, message: str, kind: type = ValueError):
        super().__init__(message)
        self.kind = kind

    def as_api_error(self) -> Exception:
        return self.kind(str(self))


@dataclass(frozen=True)
class AskedOptions:
    """The options as typed. `api`: the Python API's keywords (else a magic's flags, whose values are
    text). `no_timeline`, `predict`, `no_raise`: a magic's flags that the checks compare with the others."""

    api: bool = False
    retry: str | None = None
    accumulate: str | None = None
    floor: object = None             # `--min` text, or `min=` (the API's default 1)
    search: bool = False
    exact: bool = False
    limit: object = None             # '4GiB', '0.25', bytes
    device: object = None            # '0', 'cuda:1'
    amp: str | None = None
    timeline: object = None          # None, True, False
    no_timeline: bool = False
    timeout: object = None           # seconds (the API's ranks)
    expandable: bool = False
    predict: bool = False
    no_raise: bool = False

    # -- the checks ------------------------------------------------------------------------------------
    def check_form(self) -> None:
        """Every check that needs no values and no device; OptionError on the first that fails."""
        if self.api:
            self._check_keywords()
        else:
            self._check_flags()
        if self.limit is not None:
            self.parsed_limit()          # reject bad text now, not once a device is chosen

    def check_block(self) -> None:
        """A `with` block runs once: nothing to retry."""
        if self.retry is not None:
            raise OptionError("retry= needs a function to call again: use @oomguard(retry=...) as a decorator",
                              TypeError)

    def check_arguments(self, names, function: str) -> None:
        """The retried names are among a function's arguments (its signature's `names`)."""
        for name in (self.retry, self.accumulate):
            if name is not None and name not in names:
                raise OptionError(f"{function}() has no argument {name!r} to retry")

    def check(self, values=None, *, function: str = "fn"):
        """(meter, GuardOptions): every check, the retried names read in `values` (the namespace, or the
        function's arguments named `function`), then the meter chosen (`device`, `limit`)."""
        from cuda_magic.recover.guarded import GuardOptions

        self.check_form()
        retry = self.retry_spec(values if values is not None else {}, function=function)
        meter, limit = self.meter()
        timeline = self.timeline if self.api else (True if self.timeline else (False if self.no_timeline else None))
        options = GuardOptions(retry=retry, limit=limit, amp=self.amp, timeline=timeline,
                               source="oomguard" if self.api else "%%oomguard", api=self.api,
                               rank_timeout=self.timeout, expandable=self.expandable)
        return meter, options

    def retry_spec(self, values, *, function: str = "fn"):
        """The RetrySpec (None without a retried name), its names' values checked in `values`."""
        from cuda_magic.recover.guarded import RetrySpec

        if self.retry is None:
            return None
        floor = self.floor_value()
        if self.api:
            self.check_arguments(values, function)
            for name in (self.retry, self.accumulate):
                if name is not None:
                    if not is_positive_int(values[name]):
                        raise OptionError(f"{name} must be a positive int to be retried, not {values[name]!r}")
            if values[self.retry] < floor:
                raise OptionError(f"{self.retry}={values[self.retry]} is already below min={floor}")
        else:
            _positive_int_variable(values, self.retry, "-r")
            if self.accumulate is not None:
                _positive_int_variable(values, self.accumulate, "-a")
                if self.accumulate == self.retry:
                    raise OptionError("-a must name another variable than -r")
            if values[self.retry] < floor:
                raise OptionError(f"{self.retry} is {values[self.retry]}, already below --min {floor}")
        return RetrySpec(self.retry, self.accumulate, floor, self.search, self.exact)

    def meter(self):
        """(meter, limit bytes): the device named (or the one a guarded run meters), the cap resolved on it."""
        from cuda_magic.devices.meter import choose_meter
        from cuda_magic.devices.names import present_devices, resolve_device

        device = self.device
        if device is not None:
            try:
                device = resolve_device(device, present_devices(), flag="device=" if self.api else "-d")
            except ValueError as exc:
                raise OptionError(str(exc)) from None
        try:
            return choose_meter(device, self.parsed_limit())
        except SizeError as exc:
            raise OptionError(f"limit={self.limit!r}: {exc}" if self.api else f"-l: {exc}") from None

    def parsed_limit(self):
        """The cap as a `units.Limit` (None: none asked)."""
        if self.limit is None:
            return None
        try:
            return parse_limit(str(self.limit))
        except SizeError as exc:
            raise OptionError(str(exc) if self.api else f"-l: {exc}") from None

    def floor_value(self) -> int:
        if self.floor is None:
            return 1
        if self.api:
            return self.floor
        return whole_number(self.floor, "--min")

    # -- each form's own ------------------------------------------------------------------------------
    def _check_flags(self) -> None:
        if self.predict and (self.no_raise or self.timeline or self.no_timeline):
            flag = "--no-raise" if self.no_raise else ("--timeline" if self.timeline else "--no-timeline")
            raise OptionError(f"{flag} is for a cell that runs; --predict runs nothing on the device (drop {flag})")
        if self.timeline and self.no_timeline:
            raise OptionError("--timeline and --no-timeline exclude each other")
        if self.floor is not None:
            if self.retry is None:
                raise OptionError("--min needs -r VAR: it is the floor of the retried variable")
            if whole_number(self.floor, "--min") < 1:
                raise OptionError("--min must be at least 1")
        if self.search and self.retry is None:
            raise OptionError("--search needs -r VAR: it searches values of the retried variable")
        if self.accumulate is not None and self.retry is None:
            raise OptionError("-a VAR2 needs -r VAR: VAR2 is scaled as VAR is reduced")
        if self.exact and self.accumulate is None:
            raise OptionError("--exact needs -a VAR2: it keeps VAR x VAR2 equal to the effective batch")
        for flag, name in (("-r", self.retry), ("-a", self.accumulate)):
            if name is not None and not name.isidentifier():
                raise OptionError(f"{flag} takes a variable name, not {name!r}")

    def _check_keywords(self) -> None:
        for flag, name in (("retry", self.retry), ("accumulate", self.accumulate)):
            if name is not None and not (isinstance(name, str) and name.isidentifier()):
                raise OptionError(f"{flag}= takes the name of a keyword argument (retry=\"batch_size\"), "
                                  f"not {name!r}")
        if self.accumulate is not None and self.retry is None:
            raise OptionError("accumulate= needs retry=: it is scaled as the retried argument is reduced")
        if self.exact and self.accumulate is None:
            raise OptionError("exact=True needs accumulate=: it keeps NAME x NAME2 equal to the effective batch")
        if self.timeline not in (None, True, False):
            raise OptionError(f"timeline must be None, True or False, not {self.timeline!r}")
        floor = 1 if self.floor is None else self.floor
        if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
            raise OptionError(f"min must be an int of at least 1, not {floor!r}")
        if self.amp not in (None, "bf16", "fp16"):
            raise OptionError(f"amp must be 'bf16' or 'fp16', not {self.amp!r}")
        timeout = self.timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise OptionError(f"timeout is seconds above 0, not {timeout!r}")


def switch_expandable_segments(meter) -> str:
    """`--expandable-segments`, the first thing a run or a prediction that asked for it does: on the meter's
    simulated device its model of the allocator is switched (never CUDA's), else CUDA's allocator settings.
    Returns what it says; OptionError (nothing changed) where it cannot."""
    from cuda_magic.devices.allocator_conf import enable_expandable_segments

    simulated = meter.device if str(getattr(meter, "key", "")).startswith("sim") else None
    try:
        return enable_expandable_segments(simulated)
    except RuntimeError as exc:
        raise OptionError(f"--expandable-segments: {exc}") from None


def whole_number(text, flag: str) -> int:
    """A whole number >= 0 from what follows `flag` (`--min 4`, `%gpumem --top 5`)."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise OptionError(f"{flag} takes a whole number >= 0, not {text!r}") from None
    if value < 0:
        raise OptionError(f"{flag} takes a whole number >= 0, not {value}")
    return value


def _positive_int_variable(values, name: str, flag: str) -> None:
    if name not in values:
        raise OptionError(f"{flag} {name}: no variable {name!r} in the namespace; set it first (e.g. {name} = 64)")
    value = values[name]
    if not is_positive_int(value):
        raise OptionError(f"{flag} {name}: {name} must hold a positive int, not {value!r}")
