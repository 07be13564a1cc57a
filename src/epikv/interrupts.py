"""Ctrl-C held across work that must finish whole: a llama.cpp step (the decode and the engine's record of it) and
the commit of a calibration text's sums."""

from __future__ import annotations

import contextlib
import _signal  # signal.signal's C core: the same call without its enum wrapping, taken twice a decode step
import os
import signal
import threading


@contextlib.contextmanager
def interrupts_held():
    """Hold SIGINT (Ctrl-C) while the body runs and deliver it once the body is done: the handler only notes the
    signal, and the previous handler gets it after the body (the default one raises KeyboardInterrupt, once). A
    no-op off the main thread (the server's engine thread), where Python never runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = _signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):  # signal.default_int_handler raises KeyboardInterrupt
                previous(signal.SIGINT, caught[0])
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)
            # SIG_IGN (or a handler set outside Python): ignored, as it would have been
