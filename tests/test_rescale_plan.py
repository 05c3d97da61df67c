"""A rescale as data: the :class:`RescaleSpec` every Prepare, Suppress and Rescale carries, and
the worker's pure plan of it (:func:`elastic.worker.rescale.plan_rescale`), tested without a
process or a group."""

from __future__ import annotations

import pytest

from elastic.core import protocol as p


def test_rescale_spec_says_who_survives_and_who_sends_the_state():
    down = p.RescaleSpec(generation=2, new_size=2, mapping=(0, 1, -1), execute_on="old")
    assert (down.old_size, down.survivors, down.source, down.joining) == (3, (0, 1), 0, False)
    recover = p.RescaleSpec(generation=3, new_size=3, mapping=(-1, 0, 1), lost=(0,), keep_requests=False)
    assert (recover.survivors, recover.source, recover.joining) == ((0, 1), 0, True)
    # the same scale in its Prepare and its Rescale is the same value
    assert p.Prepare(seq=4, spec=down).spec == p.Rescale(seq=5, spec=down, prepared=True).spec
    assert p.Suppress(seq=4).announced is None


@pytest.mark.parametrize(("fields", "words"), [
    ({"new_size": 2, "mapping": ()}, "at least one old rank"),
    ({"new_size": 0, "mapping": (0,)}, "new_size must be positive"),
    ({"new_size": 2, "mapping": (0, 0)}, "names a new rank twice"),
    ({"new_size": 2, "mapping": (0, 2)}, "outside 0..1"),
    ({"new_size": 2, "mapping": (0, 1), "lost": (2,)}, "lost (2,)"),
    ({"new_size": 2, "mapping": (0, 1), "execute_on": "both"}, "execute_on"),
])
def test_rescale_spec_refuses_a_meaningless_rescale_by_name(fields, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        p.RescaleSpec(generation=1, **fields)


def test_a_rescale_command_cannot_be_built_without_its_spec():
    with pytest.raises(TypeError):
        p.Rescale(seq=1)  # type: ignore[call-arg]
