"""The GPU profile scripts' pure parts, on synthetic kernel intervals: the per-stream table and the side streams'
work on the critical path (``scripts/gpu/profile_steps.py::stream_table``)."""

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "profile_steps.py"


@pytest.fixture(scope="module")
def profile_steps():
    spec = importlib.util.spec_from_file_location("profile_steps", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stream_table(profile_steps):
    # main stream 7: a [0, 10], b [10, 20], then idle until c [30, 40]; side stream 9: s1 [5, 15] hidden behind
    # the main stream, s2 [18, 32] exposed for 10 µs (20-30), s3 [45, 50] after the main stream's span (not counted)
    ivs = [("a", 7, 0.0, 10.0), ("b", 7, 10.0, 20.0), ("c", 7, 30.0, 40.0),
           ("s1", 9, 5.0, 15.0), ("s2", 9, 18.0, 32.0), ("s3", 9, 45.0, 50.0), ("a", 7, 40.0, 42.0)]
    main, streams, exposed = profile_steps.stream_table(ivs)
    assert main == 7
    assert streams[7]["busy"] == pytest.approx(32.0) and streams[9]["busy"] == pytest.approx(29.0)
    assert streams[7]["kernels"]["a"] == [2, pytest.approx(12.0)]
    assert exposed == {"s2": pytest.approx(10.0)}


def test_stream_table_empty(profile_steps):
    assert profile_steps.stream_table([]) == (None, {}, {})


def test_critical_path(profile_steps):
    # a [0, 10] forks into b [11, 20] and a longer side branch s [11, 30]; j [31, 35] joins them, so the path is
    # a -> s -> j (s finished last before j started), with gaps of 1 µs before s and before j; b is off the path
    ivs = [("a", 1, 0.0, 10.0), ("b", 1, 11.0, 20.0), ("s", 2, 11.0, 30.0), ("j", 1, 31.0, 35.0)]
    on, gaps = profile_steps.critical_path(ivs)
    assert on == {"j": [1, pytest.approx(4.0)], "s": [1, pytest.approx(19.0)], "a": [1, pytest.approx(10.0)]}
    assert gaps == [pytest.approx(1.0), pytest.approx(1.0)]
    assert sum(v[1] for v in on.values()) + sum(gaps) == pytest.approx(35.0)  # the span
    # a kernel waiting for the host: the long gap is the path's, and two launches of one kernel add up
    on, gaps = profile_steps.critical_path([("k", 1, 0.0, 2.0), ("k", 1, 102.0, 105.0)])
    assert on == {"k": [2, pytest.approx(5.0)]} and gaps == [pytest.approx(100.0)]
    assert profile_steps.critical_path([]) == ({}, [])
