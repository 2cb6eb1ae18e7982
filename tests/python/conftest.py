"""Shared helpers of the Python tests: the ranks of a CPU group as threads."""
from __future__ import annotations

import threading


def on_ranks(num_ranks: int, body, timeout: float = 300.0):
    """Runs ``body(rank)`` on one thread per rank (the CPU backend's ranks); returns the results and
    re-raises the first rank's exception (the others' are in its notes)."""
    results = [None] * num_ranks
    errors = [None] * num_ranks

    def run(rank):
        try:
            results[rank] = body(rank)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors[rank] = error

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(num_ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), f"a rank did not return within {timeout} s (deadlock?)"
    return results, errors


def raise_first(errors):
    for error in errors:
        if error is not None:
            raise error
