"""Run a snippet in a fresh interpreter: where torch, the NVML layer or cuda_magic cache an answer, a
fault shows only in a process that has not cached it yet."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_fresh(code: str, *, env: dict | None = None, timeout: int = 180) -> str:
    """Run `code` (dedented) in a new Python with this checkout first on sys.path; its stdout.
    Fails the test with the process's output when it exits non-zero."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "PYTORCH_"))}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full_env.update(env or {})
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env=full_env, cwd=str(ROOT), timeout=timeout, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout
