"""bench/conftest.py times what the names say: the setup of a timed call (the forward before a timed
backward) finishes on the device before the timer starts."""
import importlib.util
from pathlib import Path

import torch


def _bench_conftest():
    spec = importlib.util.spec_from_file_location("bench_conftest", Path(__file__).parent.parent / "bench" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_setup_is_synchronized_before_the_timed_call(monkeypatch):
    conf = _bench_conftest()
    order = []
    monkeypatch.setattr(conf, "synchronize", lambda device: order.append(("sync", device.type)))
    run = conf.setup_then_sync(lambda: order.append("setup") or ("y",), torch.device("cuda"))
    args, kwargs = run()
    assert order == ["setup", ("sync", "cuda")]
    assert args == ("y",) and kwargs == {}


def test_device_time_flushes_the_l2_and_times_only_the_call(monkeypatch):
    """device_ms (CUDA only, so here with CUDA's event and sleep calls recorded): per round the
    setup, a sync, the sleep that holds the stream, the L2 flush, then the events around the call
    alone; the median of the event times."""
    conf = _bench_conftest()
    order, times = [], iter([3.0, 1.0, 2.0])

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            order.append("record")

        def synchronize(self):
            order.append("wait")

        def elapsed_time(self, end):
            return next(times)

    class Flush:
        def zero_(self):
            order.append("flush")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: order.append("sleep"))
    monkeypatch.setattr(conf, "synchronize", lambda device: order.append("sync"))
    monkeypatch.setattr(conf.torch, "empty", lambda *a, **k: Flush())
    setup = conf.setup_then_sync(lambda: order.append("setup") or ("x",), torch.device("cuda"))
    ms = conf.device_ms(lambda x: order.append(f"call {x}"), setup, torch.device("cuda"), rounds=3)
    one = ["setup", "sync", "sync", "sleep", "flush", "record", "call x", "record", "wait"]
    assert order == one * 3 and ms == 2.0


def test_a_peer_that_fails_to_import_is_skipped_with_its_reason(tmp_path, monkeypatch):
    """import_peer: a missing package and one whose import raises something else (a wheel carried
    with --no-deps) both skip the benchmark with the reason, instead of erroring it."""
    import pytest

    conf = _bench_conftest()
    (tmp_path / "broken_peer_zf.py").write_text("raise RuntimeError('needs transformers<5')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(pytest.skip.Exception, match="no_such_peer_zf does not import here"):
        conf.import_peer("no_such_peer_zf")
    with pytest.raises(pytest.skip.Exception, match=r"broken_peer_zf does not import here \(RuntimeError: needs"):
        conf.import_peer("broken_peer_zf")
    assert conf.import_peer("json").dumps([1]) == "[1]"


def test_compiled_peers_may_recompile_for_every_shape():
    """Dynamo's default of 8 recompiles per function turned a suite's later torch.compile rows into
    eager ones silently; the bench conftest raises the limits."""
    import torch._dynamo.config as dyn

    _bench_conftest()
    assert dyn.recompile_limit >= 512 and dyn.accumulated_recompile_limit >= 4096
