"""Supervisor: a failing background job is logged, restarted with backoff, and escalated if it persists."""

from __future__ import annotations

import threading

from twophase.supervisor import Supervision, Supervisor

QUICK = Supervision(attempts=3, first_backoff=0.001, max_backoff=0.01)


def test_a_transient_failure_is_restarted_and_the_job_resumes():
    calls, resumed, gave_up = [], threading.Event(), []

    def job(stop):
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("transient")
        resumed.set()
        stop.wait()

    sup = Supervisor("t", job, on_give_up=gave_up.append, supervision=QUICK).start()
    assert resumed.wait(30)
    sup.stop()
    assert len(calls) == 3 and gave_up == [] and sup.failure is None


def test_a_persistent_failure_is_handed_to_the_owner_with_its_cause(caplog):
    told = threading.Event()
    errors = []

    def give_up(error):
        errors.append(error)
        told.set()

    def job(stop):
        raise ValueError("broken for good")

    sup = Supervisor("publisher", job, on_give_up=give_up, supervision=QUICK).start()
    assert told.wait(30)
    sup.stop()
    assert [str(e) for e in errors] == ["broken for good"] and sup.failure is errors[0]
    assert "publisher failed 3 times in a row, giving up" in caplog.text


def test_stop_interrupts_a_job_sleeping_on_its_own_event():
    own = threading.Event()
    started = threading.Event()

    def job(stop):
        started.set()
        while not stop.is_set():
            own.wait()
            own.clear()

    sup = Supervisor("sleeper", job, on_give_up=lambda e: None, interrupt=own.set).start()
    assert started.wait(30)
    sup.stop(timeout=30)
    assert not sup._thread.is_alive()


def test_backoff_grows_to_its_bound():
    s = Supervision(first_backoff=0.5, max_backoff=3.0)
    assert [s.backoff(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
