"""Loading, unloading and reloading the extension in a real IPython shell leaves no hooks behind."""
from __future__ import annotations

import pytest
from conftest import OUR_MAGICS
from IPython.core.error import UsageError


def _ours_registered(ip) -> dict[str, set[str]]:
    table = ip.magics_manager.magics
    return {kind: names & set(table[kind]) for kind, names in OUR_MAGICS.items()}


def _our_instances(ip) -> list:
    return [v for v in ip.magics_manager.registry.values() if type(v).__module__.startswith("cuda_magic")]


def _callbacks(ip) -> dict[str, list]:
    return {k: list(v) for k, v in ip.events.callbacks.items()}


def test_load_registers_the_magics_once(bare_ip):
    ip = bare_ip
    assert _ours_registered(ip) == {"line": set(), "cell": set()}
    ip.run_line_magic("load_ext", "cuda_magic")
    assert _ours_registered(ip) == OUR_MAGICS
    instances = _our_instances(ip)
    assert len(instances) == 3
    bound = dict(ip.magics_manager.magics["line"])
    ip.run_line_magic("load_ext", "cuda_magic")      # again: nothing registered twice
    assert _our_instances(ip) == instances
    assert {n: ip.magics_manager.magics["line"][n] for n in OUR_MAGICS["line"]} == \
        {n: bound[n] for n in OUR_MAGICS["line"]}


def test_unload_removes_magics_and_every_hook(bare_ip, torch_warm):
    from cuda_magic.devices.simulated import active_device

    ip = bare_ip
    callbacks_before = _callbacks(ip)
    custom_before = (ip.custom_exceptions, ip.CustomTB)
    ip.run_line_magic("load_ext", "cuda_magic")
    ip.run_line_magic("gpumem", "--watch -q")
    ip.run_line_magic("oomguard", "on")
    ip.run_line_magic("gpumem", "--simulate 1GiB -q")
    assert _callbacks(ip) != callbacks_before
    assert ip.custom_exceptions != custom_before[0]
    assert active_device() is not None

    ip.run_line_magic("unload_ext", "cuda_magic")

    assert _ours_registered(ip) == {"line": set(), "cell": set()}
    assert _our_instances(ip) == []
    assert _callbacks(ip) == callbacks_before
    assert ip.custom_exceptions == custom_before[0]
    assert ip.CustomTB == custom_before[1]
    assert active_device() is None
    with pytest.raises(UsageError):
        ip.run_line_magic("gpumem", "")      # IPython: "Line magic function `%gpumem` not found."


def test_reload_works_and_magics_work_again(bare_ip, capsys):
    ip = bare_ip
    ip.run_line_magic("load_ext", "cuda_magic")
    ip.run_line_magic("gpumem", "--watch -q")
    ip.run_line_magic("reload_ext", "cuda_magic")
    assert _ours_registered(ip) == OUR_MAGICS
    assert len(_our_instances(ip)) == 3
    # the watcher of the first load is gone: a cell produces no watch line
    capsys.readouterr()
    ip.run_cell("x_reload = 1")
    assert "[gpumem]" not in capsys.readouterr().out
    ip.run_line_magic("gpumem", "-n 0")
    assert "CPU memory" in capsys.readouterr().out
    ip.run_line_magic("oomguard", "")
    assert "%oomguard is off" in capsys.readouterr().out


def test_unload_without_load_and_twice_is_harmless(bare_ip):
    ip = bare_ip
    ip.run_line_magic("load_ext", "cuda_magic")
    ip.run_line_magic("unload_ext", "cuda_magic")
    from cuda_magic import unload_ipython_extension

    unload_ipython_extension(ip)     # a second unload finds nothing to remove
    assert _ours_registered(ip) == {"line": set(), "cell": set()}


def test_the_state_lives_on_the_magics_objects(bare_ip):
    from cuda_magic.magics import state as state_module
    from cuda_magic.magics.state import get_state

    ip = bare_ip
    assert get_state(ip) is None
    ip.run_line_magic("load_ext", "cuda_magic")
    state = get_state(ip)
    instances = _our_instances(ip)
    assert len(instances) == 3 and all(m.cuda_magic_state is state for m in instances)
    assert set(map(id, state.magics)) == set(map(id, instances))
    registries = [k for k, v in vars(state_module).items() if isinstance(v, dict) and not k.startswith("__")]
    assert registries == []     # no module-level dict of shells
    ip.run_line_magic("unload_ext", "cuda_magic")
    assert get_state(ip) is None and all(m.cuda_magic_state is None for m in instances)


def test_unloading_one_shell_stops_only_what_that_shell_started():
    """Two shells in one process: B's unload leaves A's simulated device, watcher and magics alone."""
    import subprocess
    import sys

    code = r'''
import torch
from IPython.core.interactiveshell import InteractiveShell
from cuda_magic.devices.simulated import active_device
from cuda_magic.magics.state import get_state

a = InteractiveShell.instance()
b = InteractiveShell()
for shell in (a, b):
    shell.run_line_magic("load_ext", "cuda_magic")
a.run_line_magic("gpumem", "--simulate 64MiB -q")
a.run_line_magic("gpumem", "--watch -q")
dev_a = active_device()
b.run_line_magic("gpumem", "--simulate 32MiB -q")
assert active_device() is not dev_a and active_device().capacity == 32 * 2**20
b.run_line_magic("unload_ext", "cuda_magic")
assert get_state(b) is None and get_state(a) is not None
assert active_device() is dev_a, "B's unload must not stop A's device"
a.run_cell("import torch\nx = torch.zeros(1024)", store_history=True)
assert dev_a.allocated == 4096
assert [r.device for r in get_state(a).history] == ["sim:0"], "A's watcher still records"
assert get_state(a).history[0].allocated_delta == 4096
a.run_line_magic("unload_ext", "cuda_magic")
assert active_device() is None and not dev_a.active
print("ok")
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
