"""Execute demo.ipynb headless in a real Jupyter kernel (nbclient) and save the executed copy.

Usage: python scripts/run_demo.py [--out artifacts/demo.out.ipynb] [--timeout 600]
On a machine without a GPU the notebook uses cuda_magic's simulated device.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def execute(path: Path, timeout: int = 600):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    return nb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebook", default=str(ROOT / "demo.ipynb"))
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "demo.out.ipynb"))
    parser.add_argument("--timeout", type=int, default=600)
    args = parser.parse_args(argv)
    import nbformat

    t0 = time.perf_counter()
    nb = execute(Path(args.notebook), args.timeout)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for o in cell.get("outputs", []):
            text = o.get("text") or o.get("data", {}).get("text/plain", "")
            if text:
                print(text if isinstance(text, str) else "".join(text))
    print(f"executed {args.notebook} in {time.perf_counter() - t0:.1f} s -> {out}; error outputs: {len(errors)}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
