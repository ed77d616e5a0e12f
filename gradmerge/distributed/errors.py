"""The error every rank raises when a distributed estimate cannot be completed."""

from __future__ import annotations

from gradmerge.errors import GradmergeError


class DistributedError(GradmergeError, RuntimeError):
    """A distributed computation failed; raised on EVERY rank, with the same explanation.

    Raised when the ranks disagree (on the model, the options, or the structure of their
    estimates), when a rank failed during its part of the work (its exception is named, and on that
    rank chained as ``__cause__``), or when the other ranks did not answer within the timeout (a
    rank crashed, was killed, or hangs).

    Attributes:
        failures: rank → what went wrong there (``"NonFiniteError: ..."``); empty when the
            problem is a disagreement or a timeout rather than a rank's own exception.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})
