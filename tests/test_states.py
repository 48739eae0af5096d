"""The shared state-machine helper refuses undeclared moves and incomplete tables."""

import enum

import pytest

from twophase.states import IllegalTransition, Transitions


class Light(enum.Enum):
    RED = "red"
    GREEN = "green"
    BROKEN = "broken"


LIGHT = Transitions("light", {Light.RED: {Light.GREEN}, Light.GREEN: {Light.RED}, Light.BROKEN: ()},
                    from_any={Light.BROKEN})


def test_allowed_move_returns_target():
    assert LIGHT.check(Light.RED, Light.GREEN) is Light.GREEN


def test_illegal_move_names_machine_subject_and_states():
    with pytest.raises(IllegalTransition, match=r"light 7: red -> red is not allowed"):
        LIGHT.check(Light.RED, Light.RED, "7")


def test_from_any_reaches_every_state_but_leads_nowhere_undeclared():
    assert all(LIGHT.allows(s, Light.BROKEN) for s in Light)
    assert not LIGHT.allows(Light.BROKEN, Light.RED)


def test_table_must_cover_every_state():
    with pytest.raises(TypeError, match="no entry for"):
        Transitions("light", {Light.RED: {Light.GREEN}})
