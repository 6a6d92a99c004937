"""Run a notebook in a real JupyterLab, driven by headless Chromium through Playwright; the pieces that the
classic Notebook's harness (classic.py) shares.

`jupyter_server` starts a throwaway Jupyter server (free port, no token, temporary root, config, data and
runtime directories), `server` JupyterLab in it (its settings and workspace directories too, first-run
pop-ups off); `open_browser` launches the system Chromium (never a Playwright download);
`start_all_cells` / `wait_until_finished` / `run_all_cells` open a notebook and run it, in JupyterLab or,
with front=classic, in the classic Notebook; `run_notebook` ties them together and yields the page.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

NAME = "JupyterLab"
OUTPUT = ".jp-OutputArea-output"        # one output of a cell
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# User settings that keep a fresh JupyterLab from covering the notebook with pop-ups,
# and that attach every cell to the DOM so selectors and screenshots see the whole notebook.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
        "doNotDisturbMode": True,
    },
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none",
    },
}

# True once every code cell has left the queue: no "[*]" prompt, kernel idle, and at least
# one cell executed (so a run that has not started yet does not count as finished).
FINISHED_JS = """
() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  if (!panel || !panel.sessionContext) return false;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  if (!kernel || kernel.status !== 'idle') return false;
  const prompts = [...panel.node.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')];
  if (prompts.some(p => p.textContent.includes('*'))) return false;
  return prompts.some(p => /\\[\\d+\\]/.test(p.textContent));
}
"""

# not awaited: the command's promise settles only once every cell has run
RUN_ALL_JS = "() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }"

READY_JS = """
() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  const ctx = panel && panel.sessionContext;
  return !!(ctx && ctx.isReady && ctx.session && ctx.session.kernel
            && ctx.session.kernel.status === 'idle');
}
"""


@dataclass(frozen=True)
class LabServer:
    """A running JupyterLab: where it listens and where it keeps its files."""

    port: int
    root_dir: Path
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def notebook_url(self, name: str) -> str:
        return f"{self.base_url}/lab/tree/{name}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


THEME_SETTINGS = "@jupyterlab/apputils-extension/themes.jupyterlab-settings"


def _write_settings(settings_dir: Path, theme: str | None = None) -> None:
    """LAB_SETTINGS, and the theme ("JupyterLab Light", "JupyterLab Dark") when one is given."""
    settings = dict(LAB_SETTINGS)
    if theme is not None:
        settings[THEME_SETTINGS] = {"theme": theme}
    for rel_path, values in settings.items():
        path = settings_dir / rel_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values, indent=2))


def copy_notebook(notebook: Path, root_dir: Path) -> None:
    """Copy the notebook, pointing it at this environment's `python3` kernel so no
    kernel-selection dialog appears and the kernel runs the interpreter under test."""
    data = json.loads(notebook.read_text())
    data.setdefault("metadata", {})["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    (root_dir / notebook.name).write_text(json.dumps(data, indent=1))


def wait_until_up(proc: subprocess.Popen, server: LabServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"JupyterLab exited with code {proc.returncode}:\n{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(f"{server.base_url}/api", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"JupyterLab did not answer within {timeout_s}s:\n{server.log_tail()}")


def stop_server(proc: subprocess.Popen, server: LabServer) -> None:
    # /api/shutdown stops the kernels too; they live in their own sessions, so a signal
    # to the server's process group alone would leave them running.
    with contextlib.suppress(OSError, urllib.error.URLError):
        request = urllib.request.Request(f"{server.base_url}/api/shutdown", method="POST")
        urllib.request.urlopen(request, timeout=5).close()
    for sig, grace_s in ((None, 10), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def jupyter_server(notebook: Path, command, *, name: str, server_class=LabServer,
                   startup_timeout_s: float = 90) -> Iterator[LabServer]:
    """Start a throwaway Jupyter server: a copy of `notebook` in a temporary root directory, temporary
    config, data and runtime directories, a free port. `command(server, tmp)` gives its command line and
    any more environment variables (it may write into the temporary directory `tmp`). The server runs
    in its own process group; on exit it is asked to shut down (its kernels too), then signalled."""
    tmp = Path(tempfile.mkdtemp(prefix=f"cuda-magic-{name}-"))
    root_dir = tmp / "root"
    for path in (root_dir, tmp / "config", tmp / "data", tmp / "runtime"):
        path.mkdir()
    copy_notebook(Path(notebook), root_dir)
    server = server_class(port=free_port(), root_dir=root_dir, log_path=tmp / f"{name}.log")
    argv, extra_env = command(server, tmp)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_DATA_DIR=str(tmp / "data"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), **extra_env)
    if os.geteuid() == 0:  # CI containers run as root
        argv.append("--allow-root")
    with open(server.log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=root_dir, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_up(proc, server, startup_timeout_s)
        yield server
    finally:
        stop_server(proc, server)
        shutil.rmtree(tmp, ignore_errors=True)


def server(notebook: Path, *, startup_timeout_s: float = 90, theme: str | None = None, prepare=None):
    """Start JupyterLab with a copy of `notebook` in a temporary root directory (a context manager
    yielding the LabServer); `theme`: the theme's name in the user settings (default: JupyterLab's);
    `prepare(server, tmp)`: called before the server starts (to sign the copy with its data directory's
    notary, say)."""

    def command(server: LabServer, tmp: Path):
        if prepare is not None:
            prepare(server, tmp)
        settings_dir, workspaces_dir = tmp / "settings", tmp / "workspaces"
        _write_settings(settings_dir, theme)
        argv = [
            sys.executable, "-m", "jupyter", "lab",
            "--no-browser",
            "--expose-app-in-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={server.port}",
            "--ServerApp.port_retries=0",
            "--IdentityProvider.token=",
            "--ServerApp.password=",
            # Lets the harness POST /api/shutdown without a browser cookie; loopback only.
            "--ServerApp.disable_check_xsrf=True",
            "--ServerApp.terminals_enabled=False",
            f"--ServerApp.root_dir={server.root_dir}",
            f"--LabApp.user_settings_dir={settings_dir}",
            f"--LabApp.workspaces_dir={workspaces_dir}",
        ]
        return argv, {"JUPYTERLAB_SETTINGS_DIR": str(settings_dir),
                      "JUPYTERLAB_WORKSPACES_DIR": str(workspaces_dir)}

    return jupyter_server(notebook, command, name="lab", startup_timeout_s=startup_timeout_s)



@contextlib.contextmanager
def open_browser(viewport: tuple[int, int] = (1280, 900)) -> Iterator["Page"]:  # noqa: F821
    """A fresh page in the system Chromium, headless."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            yield page
        finally:
            browser.close()


def start_all_cells(page, url: str, *, timeout_s: float = 120, front=None) -> None:
    """Open the notebook at `url`, wait until the front end is ready (`front.READY_JS`: this module's or
    classic's; an idle kernel), and start running every cell (returns at once: look at the page while
    cells run, then `wait_until_finished`)."""
    front = front or sys.modules[__name__]
    timeout_ms = timeout_s * 1000
    page.goto(url, wait_until="domcontentloaded", timeout=timeout_ms)
    page.wait_for_function(front.READY_JS, timeout=timeout_ms, polling=200)
    page.evaluate(front.RUN_ALL_JS)


def wait_until_finished(page, *, timeout_s: float = 120, front=None) -> None:
    """Return once every cell has finished (`front.FINISHED_JS`: none queued, kernel idle) and outputs
    (widget views above all, which render after the kernel's reply) have rendered."""
    front = front or sys.modules[__name__]
    timeout_ms = timeout_s * 1000
    page.wait_for_function(front.FINISHED_JS, timeout=timeout_ms, polling=200)
    page.wait_for_timeout(500)
    page.wait_for_function(front.FINISHED_JS, timeout=timeout_ms, polling=200)


def run_all_cells(page, url: str, *, timeout_s: float = 120, front=None) -> None:
    """Open the notebook at `url`, wait for an idle kernel, run every cell, and return once
    every cell has finished (none queued, kernel idle)."""
    start_all_cells(page, url, timeout_s=timeout_s, front=front)
    page.wait_for_timeout(500)
    wait_until_finished(page, timeout_s=timeout_s, front=front)


def save_full_screenshot(page, path: Path) -> Path:
    """Screenshot the whole notebook, not only the visible part: the notebook scrolls inside
    its own panel, so the side bars are collapsed and the viewport is resized to fit the
    last cell."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra_px = page.evaluate(
        """() => {
          const shell = window.jupyterapp.shell;
          shell.collapseLeft();
          shell.collapseRight();
          const notebook = shell.currentWidget.content;
          const scroller = notebook.node.querySelector('.jp-WindowedPanel-outer')
                           || notebook.node;
          scroller.scrollTop = 0;
          const cells = notebook.node.querySelectorAll('.jp-Cell');
          const last = cells[cells.length - 1];
          const bottom = last.getBoundingClientRect().bottom
                         - scroller.getBoundingClientRect().top;
          return Math.ceil(bottom + 24 - scroller.clientHeight);
        }"""
    )
    size = page.viewport_size
    height = max(400, min(size["height"] + extra_px, 8000))
    page.set_viewport_size({"width": size["width"], "height": height})
    page.wait_for_timeout(300)
    page.screenshot(path=str(path), full_page=True)
    return path


@contextlib.contextmanager
def run_notebook(front, notebook: Path, *, screenshot: Path | None = None,
                 timeout_s: float = 120) -> Iterator["Page"]:  # noqa: F821
    """Run `notebook` in a fresh front end and yield the page once all cells finished; a full-page
    screenshot goes to `screenshot` when one is given. `front` is a module with this one's interface
    (`server`, the JS conditions, `save_full_screenshot`): lab (this one) or classic."""
    notebook = Path(notebook)
    with front.server(notebook) as server, open_browser() as page:
        try:
            run_all_cells(page, server.notebook_url(notebook.name), timeout_s=timeout_s, front=front)
        except Exception as exc:
            if screenshot is not None:
                with contextlib.suppress(Exception):
                    page.screenshot(path=str(screenshot), full_page=True)
            raise RuntimeError(f"{exc}\n--- {front.NAME} log ---\n{server.log_tail()}") from exc
        if screenshot is not None:
            front.save_full_screenshot(page, screenshot)
        yield page


def run_notebook_in_lab(notebook: Path, *, screenshot: Path | None = None, timeout_s: float = 120):
    """Run `notebook` in a fresh JupyterLab (see run_notebook)."""
    return run_notebook(sys.modules[__name__], notebook, screenshot=screenshot, timeout_s=timeout_s)


def error_outputs(page) -> list[str]:
    """Texts of error outputs in the open notebook: tracebacks, and anything on stderr that
    mentions one (a hook's traceback printed to stderr is a failure too)."""
    return page.evaluate(
        """() => {
          const panel = window.jupyterapp.shell.currentWidget;
          const found = [];
          for (const el of panel.node.querySelectorAll('.jp-OutputArea-output')) {
            const isError = el.matches('[data-mime-type="application/vnd.jupyter.error"]')
              || !!el.querySelector('[data-mime-type="application/vnd.jupyter.error"]');
            const stderr = el.matches('[data-mime-type="application/vnd.jupyter.stderr"]')
              ? el : el.querySelector('[data-mime-type="application/vnd.jupyter.stderr"]');
            const stderrTraceback = !!stderr && /Traceback|Error:/.test(stderr.textContent);
            if (isError || stderrTraceback) found.push(el.textContent.trim());
          }
          return found;
        }"""
    )


def save_element_screenshot(locator, path: Path, *, pad_px: int = 8) -> Path:
    """Screenshot one element with a white margin around it (an element screenshot alone
    cuts text flush at its edges)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import Error

    # an element a display update replaces (the classic Notebook redraws an output in a new node, 4 times
    # a second for a live gauge) can go while it is scrolled to or measured: try again
    for _ in range(20):
        try:
            locator.scroll_into_view_if_needed(timeout=2000)
            box = locator.bounding_box(timeout=2000)
        except Error:
            box = None
        if box is not None:
            break
        locator.page.wait_for_timeout(50)
    else:
        raise AssertionError(f"{locator} kept being replaced: no screenshot")
    viewport = locator.page.viewport_size
    # JupyterLab never scrolls the page itself (its panels scroll), so the element's
    # viewport coordinates are page coordinates.
    left, top = max(0, box["x"] - pad_px), max(0, box["y"] - pad_px)
    clip = {
        "x": left,
        "y": top,
        "width": min(viewport["width"], box["x"] + box["width"] + pad_px) - left,
        "height": min(viewport["height"], box["y"] + box["height"] + pad_px) - top,
    }
    locator.page.screenshot(path=str(path), clip=clip)
    return path
