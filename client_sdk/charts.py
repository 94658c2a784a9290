"""What the SDK's charts share: matplotlib, an optional extra, and how a finished figure is laid out and saved."""

from __future__ import annotations

import os

from shardtrain.errors import InvalidArgument


def pyplot():
    """matplotlib.pyplot; InvalidArgument saying how to install it when it is missing."""
    try:
        from matplotlib import pyplot as module
    except ImportError:
        raise InvalidArgument("plotting needs matplotlib: pip install 'shardtrain[plots]'") from None
    return module


def finished(figure, path: str | os.PathLike | None):
    """The figure laid out tightly, saved as PNG at `path` when given one."""
    figure.tight_layout()
    if path is not None:
        figure.savefig(path)
    return figure
