"""A stand-in for the driver's wake-up pipe, as ringd.journal.pgcall sees it."""
import os


class Tap:
    """The driver's wake-up pipe as pgcall sees it."""

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        self.drains = 0
        self.ready = True   # the driver in its loop (False: starting)

    def fileno(self):
        return self.r

    def drain(self):
        self.drains += 1
        got = set()
        while True:
            try:
                data = os.read(self.r, 512)
            except BlockingIOError:
                return got
            got.update(data)

    def put_back(self, sigs):
        os.write(self.w, bytes(sorted(sigs)))

    def send(self, sig):
        os.write(self.w, bytes([sig]))

    def close(self):
        os.close(self.r)
        os.close(self.w)
