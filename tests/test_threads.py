"""The switch interval during a first remote load's set-up (``aload._threads.setup_switches``)."""

from __future__ import annotations

import sys

import pytest

import aload
from aload import _threads


def test_a_set_up_shortens_the_switch_interval_and_puts_pythons_back(monkeypatch: pytest.MonkeyPatch) -> None:
    python_s = sys.getswitchinterval()
    monkeypatch.delenv(_threads.SETUP_SWITCH_ENV, raising=False)
    with _threads.setup_switches:
        assert sys.getswitchinterval() == pytest.approx(_threads.SETUP_SWITCH_S)
        with _threads.setup_switches:  # two set-ups at once: the first to end leaves it short
            pass
        assert sys.getswitchinterval() == pytest.approx(_threads.SETUP_SWITCH_S)
    assert sys.getswitchinterval() == python_s

    try:  # somebody else sets it meanwhile: theirs stays
        with _threads.setup_switches:
            sys.setswitchinterval(0.002)
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(python_s)

    monkeypatch.setenv(_threads.SETUP_SWITCH_ENV, "0")  # left alone
    with _threads.setup_switches:
        assert sys.getswitchinterval() == python_s
    monkeypatch.setenv(_threads.SETUP_SWITCH_ENV, "0.01")  # longer than Python's: left alone
    with _threads.setup_switches:
        assert sys.getswitchinterval() == python_s
    monkeypatch.setenv(_threads.SETUP_SWITCH_ENV, "soon")
    with pytest.raises(aload.UsageError, match=_threads.SETUP_SWITCH_ENV):
        with _threads.setup_switches:
            pass
    monkeypatch.delenv(_threads.SETUP_SWITCH_ENV)
    with _threads.setup_switches:  # the refused one left no count behind
        assert sys.getswitchinterval() == pytest.approx(_threads.SETUP_SWITCH_S)
    assert sys.getswitchinterval() == python_s
