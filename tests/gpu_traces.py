"""Where the real GPU recordings are: `../shared/gpu_traces` beside the repository (for a git worktree,
beside its main checkout too). Never copied into the project: tests that need them skip where absent."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def traces_dir() -> Path | None:
    candidates = [REPO.parent / "shared" / "gpu_traces"]
    dot_git = REPO / ".git"
    if dot_git.is_file():                      # a worktree: .git says where the main checkout's git dir is
        text = dot_git.read_text().strip()
        if text.startswith("gitdir:"):
            git_dir = Path(text.split(":", 1)[1].strip())
            main = git_dir.parent.parent.parent   # <main>/.git/worktrees/<name>
            candidates.append(main.parent / "shared" / "gpu_traces")
    return next((c for c in candidates if c.is_dir()), None)


def trace_files() -> list[Path]:
    found = traces_dir()
    return sorted(found.glob("*.pickle.gz")) if found is not None else []


def need_traces() -> Path:
    found = traces_dir()
    if found is None:
        pytest.skip("no ../shared/gpu_traces beside the repository (the real GPU recordings)")
    return found
