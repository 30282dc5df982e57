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
