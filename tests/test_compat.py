"""neofix._compat's release arithmetic and signature reading, on versions given by hand (the installed transformers
is one release; these rules decide every other one)."""

from __future__ import annotations

import pytest

from neofix import _compat


@pytest.fixture
def installed(monkeypatch):
    """Pretend the installed transformers is the given version (the cached release forgotten, and restored after)."""
    monkeypatch.setattr(_compat, "_RELEASE", None)

    def pretend(version):
        monkeypatch.setattr(_compat, "transformers_version", lambda: version)

    return pretend


def test_release_is_major_and_minor_read_once(installed):
    installed("4.30.2")
    assert _compat.release() == (4, 30)
    installed("5.1.0")
    assert _compat.release() == (4, 30)  # read once per process: a release does not change under a running program


@pytest.mark.parametrize(
    "version, since, until, inside",
    [
        ("4.36.0", "4.36", None, True),  # since: inclusive
        ("4.35.2", "4.36", None, False),
        ("4.36.0", None, "4.36", False),  # until: exclusive
        ("4.35.2", None, "4.36", True),
        ("4.36.0", "4.37", "4.40", False),  # below the range, though below its end
        ("4.40.0", "4.30", "4.40", False),  # at the range's end, though above its start
        ("4.38.1", "4.37", "4.40", True),
        ("5.30.0rc1", "5.30", None, True),  # a prerelease counts as its release
        ("5.30.0.dev0", "5.30", None, True),
        ("5.30.0.dev0", None, "5.30", False),
        ("4.38.1", None, None, True),
    ],
)
def test_in_range(installed, version, since, until, inside):
    installed(version)
    assert _compat.in_range(since, until) is inside


@pytest.mark.parametrize(
    "version, supported",
    [
        ("4.25.1", False),
        ("4.26.0", True),
        ("5.24.0", True),
        ("5.30.0rc1", True),  # prereleases of a supported release are inside the range
        ("5.30.0.dev0", True),
        ("6.0.0", False),
        ("6.0.0.dev0", False),
    ],
)
def test_is_supported(version, supported):
    assert _compat.is_supported(version) is supported


def test_positional_names_drop_self_only():
    class Model:
        def forward(self, input_ids, attention_mask=None, *, labels=None, **kwargs):
            pass

    def function(input_ids, past, /, mask=None, *rest):
        pass

    assert _compat.positional_names(Model.forward) == ("input_ids", "attention_mask")
    assert _compat.positional_names(function) == ("input_ids", "past", "mask")
    assert _compat.positional_names(lambda: None) == ()
    assert _compat.positional_names(lambda *, key: None) == ()


def test_tracer_under_each_tracer():
    """``tracer()`` at a forward's entry: eager outside any tracer; stepping aside inside torch.jit.trace (whose
    inputs are plain tensors) and torch.fx (with the traced Proxy, and with any other argument, as HFTracer passes).
    ``is_tracing()`` agrees, with or without a tensor to look at."""
    import torch

    seen = {}

    def probe(name):
        def function(x):
            seen[name] = (_compat.tracer(x), _compat.tracer(None), _compat.is_tracing(), _compat.is_tracing(x))
            return x + 1

        return function

    x = torch.ones(2)
    probe("eager")(x)
    torch.jit.trace(probe("jit"), (x,), check_trace=False)
    torch.fx.symbolic_trace(probe("fx"))
    aside = (_compat.STEPPING_ASIDE, _compat.STEPPING_ASIDE, True, True)
    assert seen == {"eager": (_compat.EAGER, _compat.EAGER, False, False), "jit": aside, "fx": aside}


def test_limits_are_read_from_the_config_attributes_named():
    """An adapter's limits come from the config attributes it names (the names differ per family): the position
    table's size (None for a family without one, whatever the config holds), the vocabulary, the width, the head
    count and the width per head, an int."""
    from types import SimpleNamespace

    from neofix._families._contract import make_limits

    config = SimpleNamespace(n_positions=2048, vocab_size=50257, n_embd=768, n_head=12, hidden_size=5, num_heads=5)
    limits = make_limits(table="n_positions", width="n_embd", heads="n_head")(config)
    assert (limits.max_positions, limits.vocab_size, limits.hidden_size, limits.heads, limits.head_dim) == (
        2048, 50257, 768, 12, 64
    )
    assert type(limits.head_dim) is int
    config = SimpleNamespace(n_positions=9, vocab_size=250880, hidden_size=1024, num_heads=16, n_embd=5, n_head=5)
    limits = make_limits(table=None, width="hidden_size", heads="num_heads")(config)
    assert (limits.max_positions, limits.vocab_size, limits.hidden_size, limits.heads, limits.head_dim) == (
        None, 250880, 1024, 16, 64
    )
