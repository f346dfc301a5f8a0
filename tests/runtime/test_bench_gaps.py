"""bench/gaps.py: the GPU-idle reading of a profile, on a hand-built chrome trace whose gaps are known."""
import json

import pytest

from bench.gaps import analyse, report


def _k(ts, dur, corr, stream=7):
    return dict(ph="X", cat="kernel", name=f"k{corr}", ts=ts, dur=dur, args=dict(stream=stream, correlation=corr))


def _launch(ts, corr):
    return dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=ts, dur=1, args=dict(correlation=corr))


def _trace():
    ev = [dict(ph="X", cat="user_annotation", name="rk.keys", ts=0, dur=100),
          dict(ph="X", cat="user_annotation", name="rk.keys.comp", ts=40, dur=50),
          dict(ph="X", cat="cpu_op", name="aten::mm", ts=55, dur=10),
          dict(ph="X", cat="cuda_runtime", name="cudaStreamSynchronize", ts=20, dur=15),
          _k(10, 20, 1), _launch(0, 1),          # [10, 30)
          _k(40, 5, 2), _launch(36, 2),          # gap 10 (30 -> 40): a sync returned at 35 inside it
          _k(60, 10, 3), _launch(58, 3),         # gap 15 (45 -> 60): launched at 58 >= 45, host-bound, in mm
          _k(72, 8, 4), _launch(20, 4),          # gap 2 (70 -> 72): launched early
          _k(75, 3, 5), _launch(74, 5),          # overlaps k4: no gap
          _k(0, 500, 9, stream=3)]               # another stream, with more kernel time than stream 7
    return ev


def test_gaps_are_found_classified_and_attributed():
    ev = [e for e in _trace() if e.get("args", {}).get("stream") != 3]
    r = analyse(ev)
    assert r["stream"] == 7 and r["kernels"] == 5
    assert r["window_us"] == pytest.approx(70) and r["busy_us"] == pytest.approx(43)
    assert r["idle_us"] == pytest.approx(27)
    assert r["kinds"] == {"after a host sync": dict(gaps=1, us=10), "host-bound": dict(gaps=1, us=15),
                          "launched early": dict(gaps=1, us=2)}
    labels = {n: (c, us) for n, c, us in r["by_label"]}
    assert labels == {"rk.keys": (2, 12), "rk.keys.comp": (1, 15)}    # launches at 36 and 20; at 58
    ops = {n: (c, us) for n, c, us in r["by_op"]}
    assert ops["aten::mm"] == (1, 15)
    assert dict(r["launches"]) == {"rk.keys": 3, "rk.keys.comp": 2}     # launches at 0, 36, 20; 58, 74
    # the stream's GPU time per label, and per kernel within it, largest first
    assert r["kernels_by_label"] == [("rk.keys", 33, [("k1", 1, 20), ("k4", 1, 8), ("k2", 1, 5)]),
                                     ("rk.keys.comp", 13, [("k3", 1, 10), ("k5", 1, 3)])]


def test_busiest_stream_is_read_and_text_report(tmp_path):
    ev = _trace()
    assert analyse(ev)["stream"] == 3                       # 500 us of kernels against 46
    p = tmp_path / "t.json"
    p.write_text(json.dumps(dict(traceEvents=[e for e in ev if e.get("args", {}).get("stream") != 3])))
    text = report(str(p), title="reuse")
    assert "GPU idle reuse: stream 7, 5 kernels" in text and "idle 0.0 ms (38.6%)" in text
    assert "rk.keys.comp" in text and "aten::mm" in text
    assert "its largest kernels" in text and "k1" in text


def test_a_trace_without_gpu_events_is_refused():
    with pytest.raises(ValueError, match="no GPU kernels"):
        analyse([dict(ph="X", cat="cpu_op", name="aten::mm", ts=0, dur=1)])


def test_ops_of_other_threads_and_python_frames():
    ev = [e for e in _trace() if e.get("args", {}).get("stream") != 3]
    for e in ev:
        e.setdefault("tid", 1)
    ev.append(dict(ph="X", cat="cpu_op", name="aten::copy_", ts=50, dur=30, tid=2))     # the stager's thread
    ev.append(dict(ph="X", cat="python_function", name="runtime/reuse/engine.py(600): _relocated_keys", ts=30,
                   dur=40, tid=1))
    ev.append(dict(ph="X", cat="python_function", name="torch/nn/modules/module.py(1): _call_impl", ts=50,
                   dur=12, tid=1))
    r = analyse(ev)
    assert {n: c for n, c, _ in r["by_op"]} == {"(none)": 2, "aten::mm": 1}       # not the other thread's copy_
    assert {n: (c, us) for n, c, us in r["by_py"]} == {"runtime/reuse/engine.py(600): _relocated_keys": (2, 25),
                                                       "(none)": (1, 2)}
