"""tools/bench/__main__.py: `python -m tools.bench MODE [options]` hands each mode its options."""
import importlib

import pytest

from tools.bench import __main__ as cli


def test_bench_modes_dispatch_to_their_files(monkeypatch, capsys):
    """Each MODE runs the bench function of its own file, tools/bench/MODE.py (`-` written `_`),
    with its options; no MODE runs every mode but gpu, in order; an unknown mode is one line naming
    the choices, before any mode runs."""
    for mode, fn in cli.BENCHES.items():
        module = importlib.import_module(f"tools.bench.{mode.replace('-', '_')}")
        assert fn.__module__ == module.__name__ and getattr(module, fn.__name__) is fn, mode
    calls = []
    for mode in cli.BENCHES:
        monkeypatch.setitem(cli.BENCHES, mode, lambda mode=mode, **kw: calls.append((mode, kw)))
    cli.main(["gpu", "--smoke", "--parts", "numerics,rollout", "--out", "DIR"])
    cli.main(["engines", "--threads", "1", "grader-compare", "--against", "old.py"])
    assert calls == [("gpu", dict(smoke=True, out="DIR", parts=["numerics", "rollout"])),
                     ("engines", dict(against="old.py", one=1)),
                     ("grader-compare", dict(against="old.py"))]
    calls.clear()
    cli.main([])
    assert [mode for mode, _ in calls] == [m for m in cli.BENCHES if m != "gpu"]
    calls.clear()
    with pytest.raises(SystemExit, match="tools.bench: unknown benchmark 'nope'; choose from "
                                         "logprobs, generate, "):
        cli.main(["flops", "nope"])
    assert calls == [] and "## gpu" in capsys.readouterr().out
