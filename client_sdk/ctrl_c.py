"""Ctrl-C handlers the SDK installs for the length of a call, on a script's main thread, only where Python's
default handler is in place: a handler of the script's own (or a notebook kernel's) is left alone."""

from __future__ import annotations

import signal
import threading


class CtrlC:
    """Installs `on_interrupt` as SIGINT's handler while in effect; `fired` says whether Ctrl-C came."""

    def __init__(self) -> None:
        self.fired = False
        self._installed = False

    def __repr__(self) -> str:
        # signal.getsignal() formats a handler that is not a signal.Handlers member (it tries Handlers(handler)):
        # kept constant and cheap, since it runs after every call.
        return f"<shardtrain {type(self).__name__}>"

    def __enter__(self):
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self.on_interrupt)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed and signal.getsignal(signal.SIGINT) == self.on_interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def on_interrupt(self, signum, frame) -> None:
        """A second Ctrl-C raises at once; the first is the subclass's."""
        if self.fired:
            raise KeyboardInterrupt
        self.fired = True
