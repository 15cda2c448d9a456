"""Ctrl-C (SIGINT) and SIGTERM in the driver: a flag, acted on where stopping is safe, then the usual cleanup.

Python's default Ctrl-C raises KeyboardInterrupt wherever the main thread
is, and inside Ray that can be half-way through its own C++ calls. Sent
while ``ray.init`` builds its core worker (the second after Ray prints
"Started a local Ray instance"), it was raised inside
``CoreWorker.__cinit__``: the launcher's cleanup never ran and the driver
died of SIGSEGV 5 s later (exit -11; the kernel log names ``_raylet.so``).
SIGTERM, what Slurm and Kubernetes send, never reached Python at all: the
failure handler Ray's C++ core installs takes it and aborts (exit -6).

Nor can the driver rely on the signals' dispositions it inherits. A step
that a non-interactive shell starts in the background (``cmd &``, as CI
runners and job scripts do) inherits SIGINT ignored, and Python then leaves
it ignored: a ``kill -INT`` of the driver did nothing, and the run trained
on (to step 2116 in 90 s here) until it was killed, the failure issue 12
saw in CI. A blocked signal mask inherited from a parent does the same. The
handlers below are installed whatever was inherited, and the two signals
unblocked: a training command is stopped by them, however it was started.

So the Ray driver runs inside ``StopSignals(defer=True)``: both signals only
record themselves, and ``check()`` raises ``Stopped`` at safe points, between
Ray calls and at least every 0.5 s in every wait, after which the launcher's
cleanup (kill the actors, remove the placement groups, stop the local
cluster) always runs. ``ray.init`` replaces the SIGTERM handler (in Python,
then in C++), so ``during_ray_init()`` keeps ours through it and installs it
again afterwards. One window stays: a SIGTERM in the fraction of a second
between Ray's C++ handler going in and ours going back still aborts the
driver; the watchdog (``watchdog.py``) then removes what it started.

With ``--launcher local`` the worker runs in this process and has no safe
points, so there the handler raises at once, as Python's Ctrl-C does.

Exit codes are the shell's for a process ended by the signal: 130 for Ctrl-C,
143 for SIGTERM. Slurm reports a job step's exit code as the script's, and
scripts that requeue preempted jobs test for 143 (SIGTERM ahead of the
SIGKILL at the time limit), so it has to differ from Ctrl-C's and from a
failure's 1.
"""

from __future__ import annotations

import contextlib
import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM asked the command to stop; ``exit_code`` is 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum

    def describe(self) -> str:
        return "interrupted" if self.signum == signal.SIGINT else f"terminated ({signal.Signals(self.signum).name})"


class StopSignals:
    """Within it (main thread only) SIGINT and SIGTERM raise ``Stopped``: at once, or with ``defer`` at ``check()``."""

    def __init__(self, defer: bool):
        self.defer = defer
        self.received: int | None = None
        self.previous: dict[int, object] = {}
        self.mask: set | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
            self.install()
            self.mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if self.mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)

    def install(self) -> None:
        if self.previous:
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
        if not self.defer:
            raise Stopped(signum)

    def check(self) -> None:
        if self.received is not None:
            raise Stopped(self.received)

    @contextlib.contextmanager
    def during_ray_init(self):
        """Keep our handlers while ``ray.init`` runs (it sets its own for SIGTERM), put them back after, then check.

        Ray sets handlers through ``signal.signal``, which is patched for the call, as Ray's own ``DeferSigint``
        does around task submission.
        """
        real = signal.signal

        def keep_ours(signum, handler):
            return signal.getsignal(signum) if signum in STOP_SIGNALS and self.previous else real(signum, handler)

        signal.signal = keep_ours
        try:
            yield
        finally:
            signal.signal = real
            self.install()  # over the C++ handler Ray's core worker put on SIGTERM
        self.check()
