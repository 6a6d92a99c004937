"""The Binder configuration (binder/) builds an environment that runs the demo.

repo2docker installs binder/requirements.txt, then runs binder/postBuild from the repository
root. The slow tests here do the same in a fresh venv and execute notebooks with that venv's
kernel.

Offline note: this machine cannot resolve download.pytorch.org, and pip retries every package
against an unreachable index (about 8 s each). When the host does not resolve, the test
installs a copy of the requirements without the `--extra-index-url` line; torch==2.13.0 then
comes from pip's configured local wheels. Everything else in the file is used as written.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BINDER = REPO_ROOT / "binder"
DEMO = REPO_ROOT / "demo.ipynb"
TORCH_PIN = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INSTALL_TIMEOUT_S = 600
CELL_TIMEOUT_S = 180


def _requirement_lines() -> list[str]:
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def _is_local_reference(line: str) -> bool:
    """Lines that make repo2docker copy the whole repository before installing (losing its
    cached requirements layer) or that resolve against the build's working directory."""
    if line.startswith(("-r", "-c", "--requirement", "--constraint")):
        return True
    if line.startswith("-"):
        parts = line.replace("=", " ", 1).split(None, 1)
        line = parts[1] if len(parts) > 1 else ""
    return line.startswith(".") or "file://" in line


def _host_resolves(url: str) -> bool:
    try:
        socket.getaddrinfo(urlparse(url).hostname, 443)
    except OSError:
        return False
    return True


def test_binder_config_is_what_repo2docker_reads():
    from packaging.requirements import Requirement

    runtime = (BINDER / "runtime.txt").read_text().strip()
    assert re.fullmatch(r"python-3\.\d+", runtime), runtime
    assert runtime == f"python-{sys.version_info.major}.{sys.version_info.minor}"

    lines = _requirement_lines()
    assert f"--extra-index-url {CPU_INDEX}" in lines
    assert TORCH_PIN in lines
    assert not [line for line in lines if _is_local_reference(line)]
    requirements = [Requirement(line) for line in lines if not line.startswith("-")]
    names = {req.name for req in requirements}
    assert {"torch", "ipywidgets"} <= names

    post_build = BINDER / "postBuild"
    assert post_build.stat().st_mode & stat.S_IXUSR, "postBuild must be executable"
    script = post_build.read_text()
    assert script.startswith("#!")
    assert re.search(r"pip install .*-e \.$", script, re.MULTILINE)


def _requirements_for_this_machine(folder: Path) -> Path:
    source = BINDER / "requirements.txt"
    if _host_resolves(CPU_INDEX):
        return source
    kept = [line for line in source.read_text().splitlines()
            if not line.strip().startswith("--extra-index-url")]
    filtered = folder / "requirements.txt"
    filtered.write_text("\n".join(kept) + "\n")
    return filtered


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                            timeout=INSTALL_TIMEOUT_S, **kwargs)
    assert result.returncode == 0, (
        f"{' '.join(map(str, command))} failed ({result.returncode}):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


@pytest.fixture(scope="module")
def binder_venv(tmp_path_factory) -> Path:
    """A fresh venv built the way repo2docker builds the Binder image."""
    if not (REPO_ROOT / "pyproject.toml").exists():
        pytest.skip("pyproject.toml not written yet: postBuild cannot install the project")
    work = tmp_path_factory.mktemp("binder")
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    env = {key: value for key, value in os.environ.items()
           if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PIP_NO_INPUT="1", PIP_PROGRESS_BAR="off")
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", "-r", str(_requirements_for_this_machine(work))],
         env=env, cwd=REPO_ROOT)
    _run(["bash", str(BINDER / "postBuild")], env=env, cwd=REPO_ROOT)
    # Binder's base image brings the kernel; a bare venv needs it installed and registered.
    _run([python, "-m", "pip", "install", "-q", "ipykernel"], env=env)
    _run([python, "-m", "ipykernel", "install", "--prefix", str(venv), "--name", "binder"],
         env=env)
    return venv


def _execute(notebook_path: Path, venv: Path):
    """Run a notebook with the venv's kernel; nbclient raises on the first failing cell."""
    import nbformat
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    notebook = nbformat.read(notebook_path, as_version=4)
    specs = KernelSpecManager(kernel_dirs=[str(venv / "share" / "jupyter" / "kernels")])
    manager = KernelManager(kernel_name="binder", kernel_spec_manager=specs)
    client = NotebookClient(notebook, km=manager, timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(notebook_path.parent)}})
    try:
        client.execute()
    finally:
        # nbclient shuts down only the kernels it started itself: one it is given (km=) is ours to stop
        if manager.has_kernel:
            manager.shutdown_kernel(now=True)
    return notebook


def _outputs(notebook) -> list[dict]:
    return [output for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.get("outputs", [])]


def _assert_no_errors(notebook) -> None:
    for output in _outputs(notebook):
        assert output["output_type"] != "error", "\n".join(output.get("traceback", []))
        if output["output_type"] == "stream" and output["name"] == "stderr":
            assert "Traceback" not in output["text"], output["text"]


def test_binder_env_runs_the_extension(binder_venv, tmp_path):
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            "import sys, torch, ipywidgets, cuda_magic\n"
            "print(sys.prefix)\nprint(torch.__version__)\nprint(cuda_magic.__file__)"
        ),
        nbformat.v4.new_code_cell("%load_ext cuda_magic"),
    ]
    path = tmp_path / "binder_smoke.ipynb"
    nbformat.write(notebook, path)

    executed = _execute(path, binder_venv)

    _assert_no_errors(executed)
    prefix, torch_version, package_file = executed.cells[0].outputs[0]["text"].split()
    assert Path(prefix).resolve() == binder_venv.resolve()
    assert torch_version.startswith("2.13.0")
    # postBuild installs the project editable, from this checkout.
    assert Path(package_file).resolve().is_relative_to(REPO_ROOT / "cuda_magic")


@pytest.mark.skipif(not DEMO.exists(), reason="demo.ipynb not written yet")
def test_binder_env_runs_the_demo(binder_venv):
    executed = _execute(DEMO, binder_venv)
    _assert_no_errors(executed)
    assert _outputs(executed), "the demo produced no output"
