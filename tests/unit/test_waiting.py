"""The tests' one wait (tests/waiting.py): it returns what the check found, and a wait that times out
says what it waited for and the last error the check raised."""

from __future__ import annotations

import itertools

import pytest

from tests.waiting import until, wait_until


async def test_until_returns_the_first_truthy_value_of_a_function_or_a_coroutine():
    calls = itertools.count()
    assert await until(lambda: next(calls) >= 3 and "ready", 5, "three calls") == "ready"

    async def check() -> int:
        return 7

    assert await until(check, 5, "a coroutine") == 7


async def test_until_names_what_it_waited_for_and_the_last_error():
    def refused() -> bool:
        raise ConnectionRefusedError("nobody listens")

    with pytest.raises(AssertionError, match=r"timed out after 0.05 s waiting for the server up "
                                             r"\(last error: ConnectionRefusedError: nobody listens\)"):
        await until(refused, 0.05, "the server up")


async def test_without_what_until_names_the_check_by_its_source():
    flag = False
    with pytest.raises(AssertionError, match=r"waiting for .*lambda: flag is True"):
        await until(lambda: flag is True, 0.02)


async def test_an_error_that_is_not_transient_fails_at_once():
    def broken() -> bool:
        raise KeyError("no such field")

    with pytest.raises(KeyError):
        await until(broken, 30, "a field")


def test_wait_until_is_the_same_in_a_thread():
    calls = itertools.count()
    assert wait_until(lambda: next(calls) >= 2 and 5, 5, "two calls", interval=0.001) == 5
    with pytest.raises(AssertionError, match=r"waiting for nothing \(last error: ValueError: not yet\)"):
        wait_until(lambda: (_ for _ in ()).throw(ValueError("not yet")), 0.02, "nothing", interval=0.001)
