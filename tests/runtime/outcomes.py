"""Listeners for the scheduler's tests: collect each request's end, and wait for all of them."""

from __future__ import annotations

import threading


class Outcomes:
    """`listener(key)` for each request; `wait(timeout)` until `expected` of them are done; `done[key]` is the
    request's Finished. An error event fails the test that waits."""

    def __init__(self, expected: int):
        self.expected = expected
        self.done: dict = {}
        self.errors: list = []
        self._all = threading.Event()

    def listener(self, key):
        def on_event(kind, payload):
            if kind == "error":
                self.errors.append(payload)
                self._all.set()
            elif kind == "done":
                self.done[key] = payload
                if len(self.done) == self.expected:
                    self._all.set()
        return on_event

    def wait(self, timeout: float) -> dict:
        assert self._all.wait(timeout), f"{len(self.done)} of {self.expected} requests finished in {timeout} s"
        assert not self.errors, self.errors
        return self.done
