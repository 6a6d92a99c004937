"""Run a notebook in the classic Jupyter Notebook 6 (the Colab environment's: Notebook 6.5 with
ipywidgets 7, whose widget protocol Colab's pinned ipywidgets speaks), driven by headless Chromium.

`notebook_server` starts a throwaway `jupyter notebook` (free port, no token, temporary root and
config directories, no banner); `run_all_cells` waits for an idle kernel and for the widget extension
(widgetsnbextension's `jupyter-js-widgets/extension`) to attach its manager to the kernel, runs every
cell and returns once all have finished. The browser, ports and shutdown are lab.py's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lab import LabServer, copy_notebook, free_port, open_browser, stop_server, wait_until_up

# The kernel is connected and idle, and the widget extension has given it a widget manager and
# registered the widget view's MIME type: before that, a widget output renders nothing.
_READY_JS = """
() => {
  const nb = window.Jupyter && window.Jupyter.notebook;
  const kernel = nb && nb.kernel;
  if (!kernel || !kernel.is_connected() || !kernel.widget_manager || !window.Jupyter.WidgetManager) return false;
  const icon = document.querySelector('#kernel_indicator_icon');
  return !!icon && icon.classList.contains('kernel_idle_icon');
}
"""

# Every code cell has a number in its prompt (none queued or running) and the kernel is idle.
_RUN_FINISHED_JS = """
() => {
  const nb = window.Jupyter.notebook;
  const code = nb.get_cells().filter(c => c.cell_type === 'code');
  if (!code.every(c => typeof c.input_prompt_number === 'number')) return false;
  const icon = document.querySelector('#kernel_indicator_icon');
  return !!icon && icon.classList.contains('kernel_idle_icon');
}
"""


class NotebookServer(LabServer):
    def notebook_url(self, name: str) -> str:
        return f"{self.base_url}/notebooks/{name}"


@contextlib.contextmanager
def notebook_server(notebook: Path, *, startup_timeout_s: float = 90) -> Iterator[NotebookServer]:
    """Start the classic Notebook with a copy of `notebook` in a temporary root directory."""
    tmp = Path(tempfile.mkdtemp(prefix="cuda-magic-nb6-"))
    root_dir = tmp / "root"
    for path in (root_dir, tmp / "config", tmp / "data", tmp / "runtime"):
        path.mkdir()
    copy_notebook(Path(notebook), root_dir)
    server = NotebookServer(port=free_port(), root_dir=root_dir, log_path=tmp / "notebook.log")
    # The widget extension is found through sys.prefix (etc/jupyter/nbconfig, share/jupyter/nbextensions),
    # which stays on the search paths whatever these variables say.
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_DATA_DIR=str(tmp / "data"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"))
    command = [
        sys.executable, "-m", "notebook",
        "--no-browser",
        "--NotebookApp.ip=127.0.0.1",
        f"--NotebookApp.port={server.port}",
        "--NotebookApp.port_retries=0",
        "--NotebookApp.token=",
        "--NotebookApp.password=",
        "--NotebookApp.disable_check_xsrf=True",   # POST /api/shutdown without a cookie; loopback only
        "--NotebookApp.terminals_enabled=False",
        "--NotebookApp.show_banner=False",
        f"--NotebookApp.notebook_dir={root_dir}",
    ]
    if os.geteuid() == 0:
        command.append("--allow-root")
    with open(server.log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=root_dir, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_up(proc, server, startup_timeout_s)
        yield server
    finally:
        stop_server(proc, server)
        shutil.rmtree(tmp, ignore_errors=True)


def run_all_cells(page, url: str, *, timeout_s: float = 120) -> None:
    timeout_ms = timeout_s * 1000
    page.goto(url, wait_until="domcontentloaded", timeout=timeout_ms)
    page.wait_for_function(_READY_JS, timeout=timeout_ms, polling=200)
    page.evaluate("() => window.Jupyter.notebook.execute_all_cells()")
    # execute_all_cells marks the cells as queued ("*") at once; a cell finishes when its prompt has a number.
    page.wait_for_function(_RUN_FINISHED_JS, timeout=timeout_ms, polling=200)
    page.wait_for_timeout(500)      # widget views render after the kernel's reply
    page.wait_for_function(_RUN_FINISHED_JS, timeout=timeout_ms, polling=200)


@contextlib.contextmanager
def run_notebook_in_classic(notebook: Path, *, screenshot: Path | None = None,
                            timeout_s: float = 120) -> Iterator["Page"]:  # noqa: F821
    """Run `notebook` in a fresh classic Notebook and yield the page once all cells finished; a
    full-page screenshot goes to `screenshot` when one is given."""
    notebook = Path(notebook)
    with notebook_server(notebook) as server, open_browser() as page:
        try:
            run_all_cells(page, server.notebook_url(notebook.name), timeout_s=timeout_s)
        except Exception as exc:
            if screenshot is not None:
                with contextlib.suppress(Exception):
                    page.screenshot(path=str(screenshot), full_page=True)
            raise RuntimeError(f"{exc}\n--- Notebook log ---\n{server.log_tail()}") from exc
        if screenshot is not None:
            save_full_screenshot(page, screenshot)
        yield page


def save_full_screenshot(page, path: Path) -> Path:
    """The whole notebook: it scrolls inside #site, so the viewport is made tall enough to hold it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    height = page.evaluate("""() => {
      const site = document.querySelector('#site');
      site.scrollTop = 0;
      return Math.ceil(site.getBoundingClientRect().top + site.scrollHeight + 16);
    }""")
    page.set_viewport_size({"width": page.viewport_size["width"], "height": max(400, min(height, 12000))})
    page.wait_for_timeout(300)
    page.screenshot(path=str(path), full_page=True)
    return path


def error_outputs(page) -> list[str]:
    """Texts of error outputs: tracebacks, a traceback on stderr, and a widget that could not render
    (the widget extension writes its failure into the output area)."""
    return page.evaluate(
        """() => {
          const found = [];
          for (const el of document.querySelectorAll('.output_area')) {
            const text = el.textContent.trim();
            const isError = !!el.querySelector('.output_error');
            const stderr = el.querySelector('.output_stderr');
            const stderrTraceback = !!stderr && /Traceback|Error:/.test(stderr.textContent);
            const widgetFailed = /could not be displayed|Error displaying widget|Failed to display Jupyter Widget/.test(text);
            if (isError || stderrTraceback || widgetFailed) found.push(text);
          }
          return found;
        }"""
    )
