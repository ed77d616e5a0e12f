"""Device names → devices, checked once for every part (library, commands, demo, ranks).

In the foundation because jobs, distributed, the demo and the commands all resolve devices
through it (no one package is its main user).

Example:
    >>> from gradmerge.foundation.devices import resolve_device
    >>> resolve_device("cpu")
    device(type='cpu')
"""

from __future__ import annotations

import torch

from gradmerge.errors import ArgumentError, DeviceUnavailableError

AUTO = "auto"
"""The device name meaning: CUDA when available, else the CPU."""


def resolve_device(spec: str | torch.device = AUTO) -> torch.device:
    """``"auto"`` → CUDA when available, else the CPU; any other name (``"cpu"``, ``"cuda"``,
    ``"cuda:N"``, a ``torch.device``) checked to exist here.

    Raises:
        ArgumentError: not a device name.
        DeviceUnavailableError: a CUDA device where there is none, or an index beyond the
            devices there are (both an :class:`ArgumentError` and a :class:`DeviceError`).
    """
    if isinstance(spec, str) and spec == AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as error:
        raise ArgumentError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {spec!r}") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"device {str(spec)!r} asked for, but CUDA is not available: use cpu or auto"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"device {str(spec)!r} asked for, but there are {torch.cuda.device_count()} "
                "CUDA devices"
            )
    return device
