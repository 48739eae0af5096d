"""The leak check of tests/conftest.py sees what a test leaves open, waits for what is being closed,
and ignores what session-lifetime objects declare as theirs."""

from __future__ import annotations

import gc
import os
import socket
import threading

from tests import leakcheck


def test_a_file_a_socket_and_a_pipe_left_open_are_reported_by_target(tmp_path):
    before = leakcheck.open_descriptors()
    f = open(tmp_path / "left-open", "wb")  # noqa: SIM115
    s = socket.socket()
    r, w = os.pipe()
    try:
        left = leakcheck.new_descriptors(before)
        assert left[f.fileno()] == str(tmp_path / "left-open")
        assert left[s.fileno()].startswith("socket:[")
        assert left[r].startswith("pipe:[") and left[w] == left[r]
        # A descriptor number closed and reused for something else is new too.
        os.unlink(tmp_path / "left-open")
        assert leakcheck.new_descriptors(before)[f.fileno()].endswith("(deleted)")
    finally:
        f.close()
        s.close()
        os.close(r)
        os.close(w)
    assert leakcheck.new_descriptors(before) == {}


def test_settle_waits_for_descriptors_and_threads_being_released():
    before_fds, before_threads = leakcheck.open_descriptors(), set(threading.enumerate())
    r, w = os.pipe()
    release = threading.Event()

    def closer():
        release.wait()
        os.close(r)
        os.close(w)

    thread = threading.Thread(target=closer)  # not a daemon: reported while it runs
    thread.start()
    fds, threads = leakcheck.new_descriptors(before_fds), leakcheck.new_threads(before_threads)
    assert set(fds) == {r, w} and threads == [thread]
    release.set()
    assert leakcheck.settle(before_fds, before_threads) == ({}, [], {})


def test_what_only_a_garbage_collection_releases_is_told_apart(tmp_path):
    before_fds, before_threads = leakcheck.open_descriptors(), set(threading.enumerate())

    class Cycle:
        def __init__(self) -> None:
            self.me = self
            self.file = open(tmp_path / "held-by-a-cycle", "wb")  # noqa: SIM115

    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collection in between: the cycle keeps the file open until settle collects it
    try:
        fd = Cycle().file.fileno()
        assert leakcheck.settle(before_fds, before_threads) == ({}, [], {fd: str(tmp_path / "held-by-a-cycle")})
    finally:
        if gc_was_enabled:
            gc.enable()


def test_descriptors_and_threads_of_session_objects_are_not_leaks():
    before_fds, before_threads = leakcheck.open_descriptors(), set(threading.enumerate())
    r, w = os.pipe()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    owner, thread_owner = (lambda: [r, w]), (lambda t: t is thread)
    leakcheck.SESSION_OWNERS.append(owner)
    leakcheck.SESSION_THREADS.append(thread_owner)
    try:
        assert leakcheck.new_descriptors(before_fds) == {} and leakcheck.new_threads(before_threads) == []
    finally:
        leakcheck.SESSION_OWNERS.remove(owner)
        leakcheck.SESSION_THREADS.remove(thread_owner)
        stop.set()
        thread.join()
        os.close(r)
        os.close(w)
    assert "fd" not in leakcheck.describe({}, [])
    assert "pipe:[1]" in leakcheck.describe({3: "pipe:[1]"}, [])
