"""The cooperative stop on SIGTERM: remembered here, agreed by all ranks at a step boundary."""

from __future__ import annotations

import signal


class StopRequest:
    """Remembers a SIGTERM so that all ranks can agree to stop at the same step boundary.

    The flag travels in the same all-reduce as the step's loss
    (:func:`~hyper_parallel.trainer.step.agreement.step_votes`): if any rank got the signal, every
    rank sees it after that step.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def install(self) -> "StopRequest":
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
