"""The one restart backoff of the exporter's child and the stores' writer threads."""

from __future__ import annotations

from passerelle.backoff import CALM_S, RestartBackoff


def test_each_death_in_a_row_doubles_the_wait_up_to_the_longest():
    b = RestartBackoff(0.5, 4.0)
    assert [b.next(lived_s=0.1) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_death_after_a_calm_run_starts_the_waits_afresh():
    b = RestartBackoff(1.0, 30.0)
    assert [b.next(lived_s=1.0) for _ in range(3)] == [1.0, 2.0, 4.0]
    assert b.next(lived_s=CALM_S) == 1.0 and b.next(lived_s=CALM_S - 1) == 2.0
