"""``kvcached.integration.common.same_signature``: the engines' hot hooks as wrappers with the wrapped method's own
parameters (no ``*args, **kwargs`` re-packing at every call)."""

from __future__ import annotations

import inspect

import pytest

from kvcached.integration.common import same_signature


class Engine:
    def step(self, request, num_tokens: int, blocks=None, *, lookahead: int = 0, must_fit: bool = False):
        """vLLM-like: positional, defaulted and keyword-only parameters."""
        return (request, num_tokens, blocks, lookahead, must_fit)

    def anything(self, a, /, b, *rest, c=3, **extra):
        return (a, b, rest, c, extra)


def test_the_wrapper_takes_and_passes_on_every_argument_as_the_original() -> None:
    seen = []
    wrapped = same_signature(Engine.step, """
        _kvc_out = CALL
        _kvc_seen.append(_kvc_out)
        return _kvc_out
    """, {"_kvc_seen": seen})
    e = Engine()
    assert wrapped(e, "r", 5) == ("r", 5, None, 0, False)
    assert wrapped(e, request="r", num_tokens=6, must_fit=True, lookahead=2) == ("r", 6, None, 2, True)
    assert wrapped(e, "r", 7, (1, 2), lookahead=1) == ("r", 7, (1, 2), 1, False)
    assert seen == [("r", 5, None, 0, False), ("r", 6, None, 2, True), ("r", 7, (1, 2), 1, False)]
    assert inspect.signature(wrapped) == inspect.signature(Engine.step)
    assert wrapped.__name__ == "step" and wrapped.__doc__ == Engine.step.__doc__ and wrapped.__wrapped__ is Engine.step
    with pytest.raises(TypeError):  # what the original refuses, the wrapper refuses
        wrapped(e, "r", 5, nonsense=1)
    with pytest.raises(TypeError):
        wrapped(e, "r", 5, None, 0)  # lookahead is keyword-only
    other = same_signature(Engine.anything, "return CALL", {})
    assert other(e, 1, 2, 3, 4, c=5, d=6) == (1, 2, (3, 4), 5, {"d": 6})
    assert inspect.signature(other) == inspect.signature(Engine.anything)


def test_a_body_can_skip_or_repeat_the_call() -> None:
    calls = []

    class Counting(Engine):
        def step(self, request, num_tokens: int, blocks=None, *, lookahead: int = 0, must_fit: bool = False):
            calls.append(request)
            return request

    wrapped = same_signature(Counting.step, """
        if request == "skip":
            return None
        try:
            return CALL
        finally:
            _kvc_done.append(request)
    """, {"_kvc_done": (done := [])})
    assert wrapped(Counting(), "skip", 1) is None and wrapped(Counting(), "go", 1) == "go"
    assert calls == ["go"] and done == ["go"]


def test_what_it_cannot_mirror_it_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decorated method (its signature read through ``__wrapped__``) keeps its defaults; the instance is ``self``
    in the body whatever the original calls it; without a readable signature, plain ``*args, **kwargs``."""
    import functools

    import kvcached.integration.common as common

    def logged(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            return fn(*args, **kwargs)
        return inner

    class Decorated(Engine):
        @logged
        def step(self, request, num_tokens: int, blocks=None, *, lookahead: int = 0, must_fit: bool = False):
            return (request, num_tokens, blocks, lookahead, must_fit)

    wrapped = same_signature(Decorated.step, "return CALL", {})
    assert wrapped(Decorated(), "r", 5) == ("r", 5, None, 0, False)  # the defaults of the signature read
    renamed = same_signature(lambda engine, n=2: (engine, n), "return (self, CALL)", {})
    assert renamed("e") == ("e", ("e", 2)) and renamed("e", n=3) == ("e", ("e", 3))

    def unreadable(fn):
        raise ValueError("no signature found")

    monkeypatch.setattr(common.inspect, "signature", unreadable)
    forwarding = same_signature(Engine.step, "return CALL", {})
    assert forwarding(Engine(), "r", 5, lookahead=1) == ("r", 5, None, 1, False)
    monkeypatch.undo()
    assert str(inspect.signature(forwarding, follow_wrapped=False)) == "(self, *args, **kwargs)"


def test_wrong_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="wraps a method"):
        same_signature(42, "return CALL", {})
    with pytest.raises(ValueError, match="call the original as CALL"):
        same_signature(Engine.step, "return None", {})
    with pytest.raises(ValueError, match="call the original as CALL"):
        same_signature(Engine.step, "   ", {})
