"""What a driver's run came to: the measurements that failed — each one
recorded and the run going on, so that one failure does not hide the
others' numbers — and whether it was interrupted. Every driver reports
them the same way and exits with the same codes."""

from __future__ import annotations

import sys
import traceback
from contextlib import contextmanager
from typing import Callable

from .procs import Interrupted, uninterruptible


class Outcome:
    def __init__(self, log: Callable[[str], None]) -> None:
        self.failed: list[str] = []
        self.interrupted: str | None = None
        self._log = log

    def attempt(self, what: str, fn, into: list | None = None):
        """fn()'s result (appended to `into` if given), or None once its
        failure is recorded. Interruptions go through: they end the run."""
        try:
            result = fn()
        except (Interrupted, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - one failure must not hide the other measurements
            traceback.print_exc()
            self.failed.append(f"{what}: {e.__class__.__name__}: {e}")
            self._log(f"{what}: FAILED: {e}")
            return None
        if into is not None:
            into.append(result)
        return result

    @contextmanager
    def torn_down_after(self, teardown: Callable[[], None]):
        """The run's body: an interruption (Ctrl-C, SIGTERM) or a failure
        outside any attempt is recorded, and `teardown` runs in every case,
        where a second Ctrl-C cannot cut it short."""
        try:
            yield
        except (Interrupted, KeyboardInterrupt) as e:
            self.interrupted = str(e) or "SIGINT"
        except Exception as e:  # noqa: BLE001 - set-up failed: report, tear down
            traceback.print_exc()
            self.failed.append(f"setup: {e.__class__.__name__}: {e}")
        finally:
            with uninterruptible():
                teardown()

    def markdown(self) -> str:
        out = ""
        if self.failed:
            out += "\n**Failed:** " + "; ".join(self.failed) + "\n"
        if self.interrupted:
            out += f"\n**Interrupted** ({self.interrupted}).\n"
        return out

    def exit_code(self) -> int:
        """Says on stderr what failed; 130 if interrupted, 1 if anything
        failed, else 0."""
        for f in self.failed:
            print(f"error: {f}", file=sys.stderr)
        if self.interrupted:
            print(f"interrupted ({self.interrupted}); everything stopped and removed", file=sys.stderr)
        return 130 if self.interrupted else (1 if self.failed else 0)
