"""``phase_profile``: phases nest, messages and bytes go to the innermost open phase, nothing is recorded
while it is off. (Its times are measured by the benchmarks; tests never time.)"""

from __future__ import annotations

import threading

from embtables.tables import phase_profile


def test_phases_nest_and_count_messages_where_they_are_sent() -> None:
    phase_profile.enable()
    try:
        for _ in range(2):
            with phase_profile.phase("outer"):
                phase_profile.count_message(100)
                with phase_profile.phase("inner"):
                    phase_profile.count_message(8)
                    phase_profile.count_message(8)
        phase_profile.count_message(1)
        snap = phase_profile.snapshot(steps=2)
    finally:
        phase_profile.enable(False)
    assert snap["outer"]["calls"] == 1 and snap["inner"]["calls"] == 1  # per step
    assert snap["outer"]["bytes"] == 100 and snap["outer"]["messages"] == 1
    assert snap["inner"]["bytes"] == 16 and snap["inner"]["messages"] == 2
    assert snap["(outside any phase)"]["messages"] == 0.5
    assert all(v["ms"] >= 0 for v in snap.values())


def test_off_records_nothing_and_threads_keep_their_own_stack() -> None:
    phase_profile.enable(False)
    with phase_profile.phase("ignored"):
        phase_profile.count_message(5)
    assert phase_profile.snapshot() == {}
    phase_profile.enable()
    try:
        with phase_profile.phase("main"):
            worker = threading.Thread(target=lambda: phase_profile.count_message(7))
            worker.start()
            worker.join()
        snap = phase_profile.snapshot()
    finally:
        phase_profile.enable(False)
    assert snap["(outside any phase)"]["bytes"] == 7  # the other thread had no phase open
    assert snap["main"]["messages"] == 0
