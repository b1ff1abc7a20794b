"""_waits.stop_on_sigterm: a SIGTERM ends the worker's call wherever the main thread is.

Found by CI on a loaded machine (Slurm preemption test): the SIGTERM reached a worker while it
was inside ``log.info``; the handler's exception was caught by logging's own ``except
Exception`` ("--- Logging error ---"), and the worker finished its round as if never told."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from collective import logs
from collective._waits import StopSignal, stop_on_sigterm
from collective.errors import AbortedError


class _SignalledHandler(logging.Handler):
    """A handler that receives SIGTERM while it formats a record, as a preempted worker did."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            self.format(record)  # the handler runs at the next bytecode: inside this try
        except Exception:  # noqa: BLE001 - logging.Handler's own policy (handleError), copied here
            self.handleError(record)


@pytest.fixture
def sigterm_handled():
    logs.set_context(phase="receive")
    previous = stop_on_sigterm("worker w0", "w0")
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    logs.set_context(phase="-")


def test_a_sigterm_inside_a_logging_call_still_ends_the_call_naming_the_phase(sigterm_handled):
    log = logging.getLogger("test.stop_signal")
    log.addHandler(_SignalledHandler())
    log.propagate = False
    try:
        with pytest.raises(StopSignal) as stop:
            log.warning("plan: 20 variables")
    finally:
        log.handlers.clear()
        log.propagate = True
    err = stop.value.error
    assert isinstance(err, AbortedError) and err.exit_code == 143
    assert str(err) == "worker w0 stopped by SIGTERM while receiving" and err.culprit == "w0"



def test_a_call_stopped_from_the_start_hands_back_the_handler_it_replaced_under_mpi():
    """``collective.sync`` ends on SIGTERM from its first statement; its MPI path runs with the
    handler from before the call (a Python handler would wait for a blocking MPI call to
    return), and the call restores it when it ends, also when stopped."""
    from collective._waits import handlers_before_the_call, stopped_from_the_start

    seen = {}

    @stopped_from_the_start
    def sync(stop: bool):
        seen["in the call"] = signal.getsignal(signal.SIGTERM)
        with handlers_before_the_call():
            seen["under mpi"] = signal.getsignal(signal.SIGTERM)
        if stop:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0.01)  # bytecodes after the kill: the handler has run by now
        return "started"

    before = signal.getsignal(signal.SIGTERM)
    assert sync(False) == "started"
    assert seen["in the call"] not in (before, signal.SIG_DFL) and seen["under mpi"] is before
    with pytest.raises(AbortedError) as info:
        sync(True)
    assert str(info.value).endswith(".sync stopped by SIGTERM while starting") and info.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_call_stopped_at_its_start_does_not_name_the_last_calls_phase():
    """A process that ran one ``collective.sync`` (its log phase left at "broadcast") and is
    stopped at the start of the next: the stop is "while starting", not "during broadcast"."""
    from collective import logs
    from collective._waits import stopped_from_the_start

    @stopped_from_the_start
    def sync():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0.01)
        return "started"

    logs.phase("broadcast")
    with pytest.raises(AbortedError) as info:
        sync()
    assert str(info.value).endswith(".sync stopped by SIGTERM while starting"), info.value
