"""A guarded cell may use top-level `await`, as any IPython cell may (issue 9, item 6): IPython's own
async execution runs it, with the guard's meter, retries and clean-up around the awaited body."""
from __future__ import annotations

from conftest import run_ok


def test_top_level_await_in_a_guarded_cell(tip):
    run_ok(tip, "import asyncio")
    result = tip.run_cell("%%oomguard -q -o\nawait asyncio.sleep(0)\nx = torch.ones(4)\nawaited = True")
    assert result.success, result.error_in_exec
    assert tip.user_ns["awaited"] is True and result.result.outcome == "ok"


def test_await_as_the_last_expression_is_displayed(tip, capsys):
    run_ok(tip, "import asyncio\nasync def value():\n    await asyncio.sleep(0)\n    return 41 + 1")
    result = tip.run_cell("%%oomguard -q\nawait value()", store_history=True)
    assert result.success, result.error_in_exec
    assert "42" in capsys.readouterr().out


def test_an_awaiting_cell_is_retried_and_cleaned_up(tip):
    run_ok(tip, "import asyncio\nbs = 1024")
    result = tip.run_cell("%%oomguard -l 64MiB -q -o -r bs\nawait asyncio.sleep(0)\nx = torch.ones(bs, 65536)")
    assert result.success, result.error_in_exec
    report = result.result
    assert report.outcome == "recovered" and [str(a.outcome) for a in report.attempts] == ["oom", "ok"]


def test_an_awaiting_cell_that_runs_out_raises_the_short_error(tip):
    run_ok(tip, "import asyncio")
    result = tip.run_cell("%%oomguard -l 16MiB -q\nawait asyncio.sleep(0)\nx = torch.ones(64, 2**20)")
    assert isinstance(result.error_in_exec, tip.user_ns["torch"].cuda.OutOfMemoryError)
    assert "out of memory in this cell" in str(result.error_in_exec)


def test_cells_without_await_are_left_to_the_usual_path_and_unload_removes_the_route(tip):
    from cuda_magic.magics.awaiting import route

    assert route in tip.input_transformers_cleanup
    assert route(["%%oomguard -q\n", "x = 1\n"]) == ["%%oomguard -q\n", "x = 1\n"]
    assert route(["%%oomguard -q\n", "async def f():\n", "    await g()\n"])[0].startswith("%%oomguard")
    tip.run_line_magic("unload_ext", "cuda_magic")
    assert route not in tip.input_transformers_cleanup
