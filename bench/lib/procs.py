"""Processes the driver starts: each in a network namespace, in its own
session (a Ctrl-C in the terminal reaches only the driver, which then stops
them in order), killed by the kernel if the driver dies, and registered so
that one call stops every one still running."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the driver is killed
    # outright (SIGKILL), its children must not keep loading the testbed.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """SIGTERM/SIGHUP, handled like Ctrl-C: a BaseException, so that no
    `except Exception` on the way swallows it."""


def _raise_interrupted(signum, _frame):
    raise Interrupted(signal.Signals(signum).name)


def stop_signals_interrupt() -> None:
    """From here, SIGINT/SIGTERM/SIGHUP raise Interrupted in the driver, so
    its `finally` tears everything down."""
    for s in _STOP_SIGNALS:
        signal.signal(s, _raise_interrupted)


@contextmanager
def uninterruptible():
    """A second Ctrl-C must not cut the clean-up short (every step of it is
    bounded in time); afterwards the signals act as usual again."""
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    try:
        yield
    finally:
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)


def ns_argv(netns: str | None, argv: list[str]) -> list[str]:
    """argv run inside a named network namespace. `nsenter --net` keeps the
    mount namespace, so bpffs pins stay visible (`ip netns exec` would
    remount /sys)."""
    if netns is None:
        return list(argv)
    return ["nsenter", f"--net=/run/netns/{netns}", "--", *argv]


class Procs:
    def __init__(self) -> None:
        self._running: list[tuple[str, subprocess.Popen]] = []

    def spawn(
        self, name: str, netns: str | None, argv: list[str], log: Path, env: dict | None = None, cwd: Path | None = None
    ) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            p = subprocess.Popen(
                ns_argv(netns, argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env=env,
                cwd=cwd,
            )
        self._running.append((name, p))
        return p

    def stop(self, p: subprocess.Popen, grace_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`; returns the exit status."""
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)
        self._running = [(n, q) for n, q in self._running if q is not p]
        return p.returncode

    def stop_all(self) -> None:
        # Reverse start order: load generators and balancers before servers.
        for _name, p in reversed(list(self._running)):
            try:
                self.stop(p)
            except Exception:  # noqa: BLE001 - tear-down goes on regardless
                pass

    def stop_except(self, keep: set[str]) -> None:
        """Stops every process not named in `keep`, newest first."""
        for name, p in reversed(list(self._running)):
            if name not in keep:
                self.stop(p)

    def running(self) -> list[str]:
        return [n for n, p in self._running if p.poll() is None]


def run(
    netns: str | None, argv: list[str], *, timeout: float = 30.0, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess:
    """A short command, bounded in time; output captured."""
    cp = subprocess.run(ns_argv(netns, argv), capture_output=True, text=True, timeout=timeout, input=input)
    if check and cp.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} (netns {netns}) failed with {cp.returncode}: {cp.stderr.strip() or cp.stdout.strip()}")
    return cp


class Fatal(Exception):
    """Raised from a `wait_until` check: stop waiting, nothing will change."""


def wait_until(what: str, ok, timeout_s: float, interval_s: float = 0.1):
    """Polls `ok()` until it returns a truthy value, at most `timeout_s`;
    other exceptions are retried, `Fatal` ends the wait at once."""
    deadline = time.monotonic() + timeout_s
    last_err = None
    while time.monotonic() < deadline:
        try:
            v = ok()
            if v:
                return v
        except Fatal:
            raise
        except Exception as e:  # noqa: BLE001 - remembered for the message
            last_err = e
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}" + (f" (last error: {last_err})" if last_err else ""))
