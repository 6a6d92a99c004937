"""Importing cuda_magic and loading the extension stay cheap: no torch, pandas, ipywidgets or pynvml."""
from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "pandas", "ipywidgets", "pynvml")


def _heavy_modules_after(code: str) -> list[str]:
    probe = code + f"\nimport sys, json\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_loads_no_heavy_module():
    assert _heavy_modules_after("import cuda_magic") == []


def test_public_api_names_resolve_lazily():
    code = ("import cuda_magic\nassert callable(cuda_magic.parse_size)\n"
            "assert 'load_ipython_extension' in dir(cuda_magic)")
    assert _heavy_modules_after(code) == []


def test_load_ext_in_a_fresh_shell_loads_no_heavy_module():
    code = (
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "ip.run_line_magic('load_ext', 'cuda_magic')\n"
        "assert 'gpumem' in ip.magics_manager.magics['line']\n"
        "assert 'oomguard' in ip.magics_manager.magics['cell']\n"
    )
    assert _heavy_modules_after(code) == []


def test_freecuda_in_a_kernel_that_never_imported_torch_imports_nothing_heavy():
    code = (
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "ip.run_line_magic('load_ext', 'cuda_magic')\n"
        "ip.run_cell('data = [1, 2, 3]\\n1 / 0')\n"           # a failed cell: release has refs to drop
        "for line in ('', '-n', '--all', '--offload data', 'data'):\n"
        "    ip.run_line_magic('freecuda', line + ' -q')\n"
        "assert 'data' not in ip.user_ns\n"
    )
    assert _heavy_modules_after(code) == []


def test_unknown_attribute_is_an_attribute_error():
    code = (
        "import cuda_magic\n"
        "try:\n    cuda_magic.no_such_thing\nexcept AttributeError as e:\n    assert 'no_such_thing' in str(e)\n"
        "else:\n    raise SystemExit('no AttributeError')\n"
    )
    assert _heavy_modules_after(code) == []


def test_the_api_in_a_plain_script_never_imports_ipython():
    code = ("import sys, torch, cuda_magic\n"
            "x = torch.ones(10); v = x[:3]\n"
            "snap = cuda_magic.snapshot()\n"
            "report = cuda_magic.release()\n"
            "print(len(snap.tensor_list), sum(r.views for r in snap.tensor_list), 'IPython' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    storages, views, ipython = out.stdout.split()
    assert int(storages) >= 1 and int(views) >= 2 and ipython == "False"
