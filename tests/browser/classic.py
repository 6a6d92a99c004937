"""Run a notebook in the classic Jupyter Notebook 6 (the Colab environment's: Notebook 6.5 with
ipywidgets 7, whose widget protocol Colab's pinned ipywidgets speaks), driven by headless Chromium.

`server` starts a throwaway `jupyter notebook` (lab.jupyter_server: free port, no token, temporary root
and config directories; no banner); `run_all_cells` waits for an idle kernel and for the widget extension
(widgetsnbextension's `jupyter-js-widgets/extension`) to attach its manager to the kernel (READY_JS),
runs every cell (RUN_ALL_JS) and returns once all have finished (FINISHED_JS). The browser, ports,
shutdown and the running of cells (lab.start_all_cells, lab.wait_until_finished with front=classic) are
lab.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lab import LabServer, jupyter_server, run_notebook

NAME = "Notebook"
OUTPUT = ".output_area"        # one output of a cell

# The kernel is connected and idle, and the widget extension has given it a widget manager and
# registered the widget view's MIME type: before that, a widget output renders nothing.
READY_JS = """
() => {
  const nb = window.Jupyter && window.Jupyter.notebook;
  const kernel = nb && nb.kernel;
  if (!kernel || !kernel.is_connected() || !kernel.widget_manager || !window.Jupyter.WidgetManager) return false;
  const icon = document.querySelector('#kernel_indicator_icon');
  return !!icon && icon.classList.contains('kernel_idle_icon');
}
"""

# execute_all_cells marks the cells as queued ("*") at once; a cell finishes when its prompt has a number.
RUN_ALL_JS = "() => window.Jupyter.notebook.execute_all_cells()"

# Every code cell has a number in its prompt (none queued or running) and the kernel is idle.
FINISHED_JS = """
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


def available() -> bool:
    """The classic Notebook (6.x) with ipywidgets' classic extension (widgetsnbextension 3.x)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("notebook").split(".")[0]) < 7 and int(version("widgetsnbextension").split(".")[0]) < 4
    except PackageNotFoundError:
        return False


def server(notebook: Path, *, startup_timeout_s: float = 90):
    """Start the classic Notebook with a copy of `notebook` in a temporary root directory (a context
    manager yielding the NotebookServer). The widget extension is found through sys.prefix
    (etc/jupyter/nbconfig, share/jupyter/nbextensions), which stays on the search paths whatever the
    temporary JUPYTER_* directories say."""

    def command(server: NotebookServer, tmp: Path):
        return [
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
            f"--NotebookApp.notebook_dir={server.root_dir}",
        ], {}

    return jupyter_server(notebook, command, name="nb6", server_class=NotebookServer,
                          startup_timeout_s=startup_timeout_s)


def run_notebook_in_classic(notebook: Path, *, screenshot: Path | None = None, timeout_s: float = 120):
    """Run `notebook` in a fresh classic Notebook (see lab.run_notebook)."""
    return run_notebook(sys.modules[__name__], notebook, screenshot=screenshot, timeout_s=timeout_s)


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
