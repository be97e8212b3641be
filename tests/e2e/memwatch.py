"""Peak memory of a modeld process, for the tests that bound what one request
may cost (issue 24): VmHWM from /proc/PID/status, reset to the current RSS
before the request by writing "5" to /proc/PID/clear_refs (Linux >= 4.0), so
what a test reads afterwards is the request's own peak, not the start-up's or
a deploy's."""

import pytest

MB = 1 << 20


def proc_status(pid, key):
    """A /proc/PID/status value in bytes (VmHWM, VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no {key}")


class PeakGrowth:
    """with PeakGrowth(pid) as g: <request>; then g.bytes is how far the peak
    RSS rose above the RSS at the start."""

    def __init__(self, pid):
        self.pid = pid
        self.bytes = None

    def __enter__(self):
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError as e:
            pytest.skip(f"cannot reset the peak RSS of pid {self.pid}: {e}")
        self.start = proc_status(self.pid, "VmRSS")
        return self

    def __exit__(self, *exc):
        self.bytes = proc_status(self.pid, "VmHWM") - self.start
        return False


def wait_threads_gone(pid, prefixes, timeout):
    """Wait until no thread of `pid` has a name starting with one of
    `prefixes` (a released model's workers, "md-NAME" and "mj-NAME", finish
    what they started before they exit), so a measurement that follows is
    the request's alone. Fails after `timeout` seconds."""
    import os
    import time
    deadline = time.monotonic() + timeout
    while True:
        names = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:
                pass  # the thread ended meanwhile
        busy = [n for n in names if n.startswith(tuple(prefixes))]
        if not busy:
            return
        assert time.monotonic() < deadline, f"threads still running after {timeout} s: {busy}"
        time.sleep(0.05)
