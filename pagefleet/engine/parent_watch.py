"""A child process's watchdog on its parent (torch-free: the engine core's host uses it)."""

from __future__ import annotations

import os
import time


def watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as its parent is gone (polls every 0.5 s)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)  # the driver died: nothing left to serve
        time.sleep(0.5)
