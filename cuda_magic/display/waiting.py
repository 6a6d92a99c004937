"""A line that says a long step is under way (`%%oomguard --predict`'s fake runs), in notebooks only.

Nothing shows for a step shorter than `delay` seconds; after that one line, its seconds counted once a
second, from a daemon thread. It is published through the display publisher the shell had when the step
began (the step may capture what it displays: capture_output swaps the shell's publisher) and routed to
the running cell (the thread runs in a copy of its context). `finish(obj)` puts the record's HTML and text
in the line's place, so no progress line is left in the notebook.
"""
from __future__ import annotations

import contextvars
import threading
import time
import uuid
from html import escape

from cuda_magic.display.elements import BOX, MUTED

DELAY = 1.0
INTERVAL = 1.0


class Waiting:
    def __init__(self, words: str, *, delay: float = DELAY, interval: float = INTERVAL):
        self.words, self.delay, self.interval = words, delay, interval
        self.pub = None
        self.display_id = uuid.uuid4().hex
        self.shown = 0                  # how many times the line was drawn
        self._stop = threading.Event()
        self._thread = None
        self._t0 = 0.0

    def bundle(self, seconds: float) -> dict:
        line = f"{self.words} ({seconds:.0f} s)"
        return {"text/plain": line,
                "text/html": f'<div class="cuda-magic-waiting" style="{BOX}"><span style="{MUTED}">⏳</span> '
                             f'{escape(line)}</div>'}

    def __enter__(self) -> Waiting:
        from cuda_magic.display.gauge import gauge_possible
        from cuda_magic.ipython import current_shell

        if gauge_possible():
            self.pub = current_shell().display_pub
            self._t0 = time.monotonic()
            context = contextvars.copy_context()
            self._thread = threading.Thread(target=context.run, args=(self._run,), daemon=True,
                                            name="cuda_magic waiting line")
            self._thread.start()
        return self

    def _publish(self, data: dict, update: bool) -> None:
        self.pub.publish(data, metadata={}, transient={"display_id": self.display_id}, update=update)

    def _run(self) -> None:
        wait = self.delay
        while not self._stop.wait(wait):
            self._publish(self.bundle(time.monotonic() - self._t0), update=self.shown > 0)
            self.shown += 1
            wait = self.interval

    def __exit__(self, *exc) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def finish(self, obj=None) -> bool:
        """Put `obj`'s HTML and text (None: nothing) where the line is; False where no line was shown (the
        caller shows `obj` itself)."""
        if not self.shown:
            return False
        if obj is None:
            self._publish({"text/plain": ""}, update=True)
            return True
        from cuda_magic.display.show import forms_of

        text, html, _ = forms_of(obj)
        self._publish({"text/html": html(), "text/plain": text()}, update=True)
        return True
