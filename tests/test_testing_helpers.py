"""neofix.testing, imported directly (tests/test_plugin.py covers the pytest plugin): the tiny model builders and
assert_generation_consistent, as a downstream CI calls them."""

from __future__ import annotations

import pytest
import torch
import transformers

from neofix.testing import (
    FAMILY_CONFIGS,
    assert_generation_consistent,
    tiny_config,
    tiny_gpt_neo,
    tiny_gpt_neo_config,
    tiny_model,
)

PROMPT = torch.tensor([[5, 6, 7]])  # the tiny GPT-Neo of seed 0 generates no eos (token 0) for 46 tokens after it


def same_weights(a, b):
    one, other = a.state_dict(), b.state_dict()
    return one.keys() == other.keys() and all(torch.equal(one[name], other[name]) for name in one)


def test_the_defaults_are_the_gpt_neo_of_seed_0_in_float32():
    """``tiny_model()`` and ``tiny_gpt_neo()`` are the same model as ``seed=0``, float32, eval mode; another seed is
    another model; ``tiny_config()`` is GPT-Neo's tiny config."""
    default = tiny_gpt_neo()
    assert type(default) is transformers.GPTNeoForCausalLM and not default.training
    assert {p.dtype for p in default.parameters()} == {torch.float32}
    assert same_weights(default, tiny_gpt_neo(seed=0))
    assert not same_weights(default, tiny_gpt_neo(seed=1))
    model = tiny_model()
    assert type(model) is transformers.GPTNeoForCausalLM
    assert same_weights(model, tiny_model(seed=0)) and same_weights(model, default)
    assert not same_weights(tiny_model(seed=1), default)
    config = tiny_config()
    assert type(config) is transformers.GPTNeoConfig
    assert config.to_dict() == tiny_gpt_neo_config().to_dict()


@pytest.mark.parametrize("family", ["gpt_neo", "gpt2"])
def test_dtype_and_overrides_reach_the_model(family):
    """``dtype`` is the parameters' dtype, and config overrides build the model (GPT-Neo's attention layers rebuilt
    for another ``num_layers``), whichever family."""
    layers = {"gpt_neo": "num_layers", "gpt2": "n_layer"}[family]
    model = tiny_model(family, dtype=torch.float64, **{layers: 3})
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert len(model.transformer.h) == 3 and getattr(model.config, layers) == 3
    if family == "gpt_neo":
        assert model.config.attention_layers == ["global", "local", "global"]
        assert tiny_config("gpt_neo", num_layers=3).attention_layers == ["global", "local", "global"]
        assert {p.dtype for p in tiny_gpt_neo(dtype=torch.float64).parameters()} == {torch.float64}
    assert {p.dtype for p in tiny_model(family, dtype=torch.bfloat16).parameters()} == {torch.bfloat16}


def test_assert_generation_consistent_compares_16_new_tokens_by_default(monkeypatch):
    model = tiny_gpt_neo()
    lengths = []
    generate = model.generate

    def recording(*args, **kwargs):
        output = generate(*args, **kwargs)
        lengths.append(output.shape[1])
        return output

    monkeypatch.setattr(model, "generate", recording)
    assert_generation_consistent(model, PROMPT)
    assert lengths == [PROMPT.shape[1] + 16]


class StopAfter(transformers.StoppingCriteria):
    """Stops generate at ``length`` columns: a criterion the reference does not know."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[-1] >= self.length, dtype=torch.bool)


def test_a_shorter_generation_is_named_with_the_trace_cut_at_40_forwards():
    """generate stopped early by a criterion of its own: the message says how many tokens each produced, and lists
    the first 40 traced forwards, then how many more there were."""
    model = tiny_gpt_neo()
    stop = transformers.StoppingCriteriaList([StopAfter(PROMPT.shape[1] + 41)])
    with pytest.raises(AssertionError) as caught:
        assert_generation_consistent(model, PROMPT, max_new_tokens=45, stopping_criteria=stop)
    lines = str(caught.value).splitlines()
    assert lines[0] == (
        "cached generation produced 41 new tokens, the full-recompute reference 45 (the tokens they share agree): "
        "a stopping criterion the reference does not know about?"
    )
    assert lines[1] == "trace (41 forwards):"
    assert len(lines) == 2 + 40 + 1 and lines[-1] == "  ... 1 more"
    assert all(line.startswith("  ") for line in lines[2:])


def test_a_family_without_a_tiny_model_is_a_value_error_that_lists_them():
    """``tiny_model("falcon")`` raised a bare ``KeyError: 'falcon'`` (the plugin's fixture too), before Falcon was a
    family; ``tiny_config``'s ``ValueError`` names the families there are (Mamba stands in for one neofix lacks)."""
    for build in (tiny_model, tiny_config):
        with pytest.raises(ValueError, match=r"no tiny model for family 'mamba'; choose from \['bloom', 'codegen'"):
            build("mamba")


def test_a_family_this_release_does_not_have_is_a_value_error_that_says_so(monkeypatch):
    """On a release without the family's classes (Llama before 4.30: ``AttributeError`` from ``transformers``), a
    ``ValueError`` naming the release and the class; where this release has Llama, a class name it lacks stands in."""
    config_class, model_class, values = FAMILY_CONFIGS["llama"]
    if hasattr(transformers, config_class):
        config_class = model_class = "NotInThisReleaseForCausalLM"
        monkeypatch.setitem(FAMILY_CONFIGS, "llama", (config_class, model_class, values))
    with pytest.raises(ValueError) as raised:
        tiny_model("llama")
    assert str(raised.value) == (
        f"neofix.testing: transformers {transformers.__version__} has no {config_class}, so it has no tiny 'llama' "
        "model (neofix's \"Families and releases\" page lists the release each family needs)"
    )
