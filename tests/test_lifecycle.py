"""patch / unpatch / is_patched, the post-import hook, environment variables, and never crashing an import."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
from transformers.models.gpt_neo import modeling_gpt_neo

import neofix
from neofix import _lifecycle
from neofix._families import FAMILIES

from . import _fresh
from ._versions import has

OWNERS = {
    "GPTNeoModel": "forward",
    "GPTNeoForCausalLM": ("prepare_inputs_for_generation", "generate"),
    "GPTNeoSelfAttention": "forward",
    "GPTNeoFlashAttention2": "forward",
}


def class_attributes():
    """Each patch target's own class attribute (or None when the class inherits it), by identity."""
    found = {}
    for owner, names in OWNERS.items():
        cls = getattr(modeling_gpt_neo, owner, None)
        if cls is None:
            continue
        for name in (names,) if isinstance(names, str) else names:
            found[f"{owner}.{name}"] = vars(cls).get(name)
    found["modeling_gpt_neo._prepare_4d_causal_attention_mask"] = vars(modeling_gpt_neo).get(
        "_prepare_4d_causal_attention_mask"
    )
    return found


def run_python(code, **env):
    """Run ``code`` in a fresh interpreter (``python -W default -c``, forked from a warm one: :mod:`tests._fresh`);
    return its stdout parsed as JSON (the last line)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NEOFIX_")}
    environment.update(env)
    result = _fresh.run(code, environment, warnoptions=("default",))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_patch_and_unpatch_are_idempotent():
    assert neofix.is_patched()
    patched = class_attributes()
    assert neofix.patch() is False  # already patched: nothing changes
    assert class_attributes() == patched
    assert neofix.unpatch() is True
    restored = class_attributes()
    assert neofix.unpatch() is False
    assert class_attributes() == restored
    assert not neofix.is_patched()
    assert neofix.patch() is True
    assert neofix.is_patched()


def test_unpatch_restores_transformers_exactly():
    neofix.unpatch()
    before = class_attributes()
    neofix.patch()
    during = class_attributes()
    wrapped = [name for name, value in during.items() if value is not before[name]]
    assert "GPTNeoModel.forward" in wrapped
    assert "GPTNeoForCausalLM.generate" in wrapped
    # the eager attention takes a local window over a static cache at the tokens' slots (4.45 and later)
    assert ("GPTNeoSelfAttention.forward" in wrapped) is has("attention layers get the whole cache")
    for name in wrapped:
        made_in = during[name].__code__.co_filename  # a plain function: dynamo can guard it
        assert made_in.endswith("_wrappers.py") or made_in.endswith("gpt_neo.py"), made_in
        assert during[name].__wrapped__ is (before[name] or during[name].__wrapped__)
    neofix.unpatch()
    after = class_attributes()
    for name in before:
        assert after[name] is before[name], name  # the very same objects, not copies


def test_inherited_methods_are_deleted_not_copied():
    from transformers.generation import GenerationMixin

    cls = modeling_gpt_neo.GPTNeoForCausalLM
    neofix.unpatch()
    own = "prepare_inputs_for_generation" in vars(cls)
    neofix.patch()
    assert "generate" in vars(cls) and "prepare_inputs_for_generation" in vars(cls)
    neofix.unpatch()
    assert "generate" not in vars(cls)
    assert cls.generate is GenerationMixin.generate
    assert ("prepare_inputs_for_generation" in vars(cls)) is own
    if not own:  # transformers >= 4.48 inherits it from GenerationMixin
        assert cls.prepare_inputs_for_generation is GenerationMixin.prepare_inputs_for_generation


def test_status_names_every_target():
    rows = {name: (state, reason) for name, state, reason in _lifecycle.status()}
    assert rows["GPTNeoModel.forward"][0] == "patched"
    if has("attention layers get the whole cache"):
        assert rows["GPTNeoSelfAttention.forward"][0] == "patched"
    else:
        assert rows["GPTNeoSelfAttention.forward"][0] == "skipped"
        assert "take no cache object, so no static cache reaches them" in rows["GPTNeoSelfAttention.forward"][1]
    assert set(rows) == {_lifecycle.target_name(f, target) for f in FAMILIES.values() for target in f.targets}
    from neofix import _compat

    for family in FAMILIES.values():
        loaded = family.module in sys.modules
        for target in family.targets:
            state, reason = rows[_lifecycle.target_name(family, target)]
            if not loaded and target.since and not _compat.in_range(target.since, None):
                # a family this release does not have (Qwen3 on 4.45): skipped, saying from which release
                assert state == "skipped" and reason.endswith(target.why), (target, state, reason)
                continue
            assert (state in ("patched", "skipped") if loaded else state == "pending") and reason, (target, state)
            if not loaded:
                assert reason == f"patched when transformers loads {family.module.rsplit('.', 1)[-1]}"
    neofix.unpatch()
    assert {state for _, state, _ in _lifecycle.status()} == {"unpatched"}


def test_missing_target_warns_and_patches_the_rest(monkeypatch):
    neofix.unpatch()
    monkeypatch.delattr(modeling_gpt_neo, "GPTNeoForCausalLM")
    with pytest.warns(neofix.NeofixWarning) as caught:
        assert neofix.patch() is True
    messages = " | ".join(str(warning.message) for warning in caught)
    assert "GPTNeoForCausalLM.generate does not exist" in messages
    assert "GPTNeoForCausalLM.prepare_inputs_for_generation does not exist" in messages
    rows = {name: state for name, state, _ in _lifecycle.status()}
    assert rows["GPTNeoForCausalLM.generate"] == "missing"
    assert rows["GPTNeoForCausalLM.prepare_inputs_for_generation"] == "missing"
    assert rows["GPTNeoModel.forward"] == "patched"
    neofix.unpatch()
    monkeypatch.undo()


def test_unsupported_transformers_is_left_alone(monkeypatch):
    from neofix import _compat

    neofix.unpatch()
    before = class_attributes()
    monkeypatch.setattr(_compat, "transformers_version", lambda: "4.20.0")
    with pytest.warns(neofix.NeofixWarning, match=r"transformers 4.20.0 is outside the tested range >=4.26,<6"):
        assert neofix.patch() is False
    assert not neofix.is_patched()
    assert class_attributes() == before
    monkeypatch.undo()


def test_a_failing_patch_leaves_nothing_half_applied(monkeypatch):
    from neofix import _wrappers

    neofix.unpatch()
    before = class_attributes()

    def broken(original, adapter):
        raise RuntimeError("this factory fails")

    monkeypatch.setattr(_wrappers, "make_generate", broken)  # fails after GPTNeoModel.forward is patched
    monkeypatch.setattr(_lifecycle, "_hooks_enabled", True)  # as at import: unpatch() turned the hook off
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _lifecycle._on_import(modeling_gpt_neo)  # the hook never raises into the user's import
    assert [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)] == [
        "neofix: patching GPT-Neo failed (RuntimeError: this factory fails); it is left unpatched"
    ]
    assert not neofix.is_patched()
    assert class_attributes() == before
    rows = {name: state for name, state, _ in _lifecycle.status() if name in _gpt_neo_target_names()}
    assert rows and set(rows.values()) == {"unpatched"}, rows  # none still said "patched"
    monkeypatch.undo()


def _gpt_neo_target_names():
    family = FAMILIES["gpt_neo"]
    return {_lifecycle.target_name(family, target) for target in family.targets}


def test_unpatch_turns_the_import_hook_off():
    neofix.unpatch()
    _lifecycle._on_import(modeling_gpt_neo)
    assert not neofix.is_patched()


def test_import_neofix_before_transformers():
    out, _ = run_python(
        """
        import json, sys, neofix
        before = neofix.is_patched(), "wrapt" in sys.modules
        from transformers import GPTNeoForCausalLM
        print(json.dumps([*before, neofix.is_patched(), neofix.patch()]))
        """
    )
    assert out == [False, False, True, False]  # wrapt waits for GPT-Neo; a later patch() changes nothing


def test_patch_loads_no_other_family_and_their_hooks_patch_them_later():
    """``patch()`` imports GPT-Neo's modeling module only: another family is patched by its import hook, when
    transformers loads it (after an unpatch/patch too)."""
    out, _ = run_python(
        """
        import json, sys, neofix
        from transformers import GPTNeoForCausalLM
        neofix.unpatch()
        patched = neofix.patch()
        loaded = [m for m in sys.modules if m.startswith("transformers.models.") and m.endswith(
            ("modeling_gpt2", "modeling_gptj", "modeling_codegen", "modeling_gpt_neox", "modeling_opt", "modeling_bloom"))]
        from transformers import GPT2LMHeadModel
        from transformers.models.gpt2 import modeling_gpt2
        print(json.dumps([patched, loaded, getattr(modeling_gpt2.GPT2Model.forward, "__neofix_wrapper__", False)]))
        """
    )
    assert out == [True, [], True]


def test_explicit_patch_before_gpt_neo_is_imported_applies_once():
    out, _ = run_python(
        """
        import json, neofix
        from neofix import _lifecycle
        first = neofix.patch()  # imports GPT-Neo, which fires the hook inside this call
        print(json.dumps([first, sum(map(len, _lifecycle._applied.values())), neofix.patch()]))
        """
    )
    from neofix import _lifecycle as here

    assert out == [True, len(here._applied["gpt_neo"]), False]  # GPT-Neo's targets only: no other family loaded


def test_model_built_before_import_is_covered():
    out, _ = run_python(
        """
        import json, warnings, torch
        from transformers import GPTNeoConfig, GPTNeoForCausalLM
        torch.manual_seed(0)
        model = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=64, max_position_embeddings=32, hidden_size=16,
                                              num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
                                              window_size=4)).eval()
        import neofix
        ids = torch.randint(0, 64, (1, 5))
        mask = torch.ones_like(ids)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            cache = out["cache"] if "cache" in out.keys() else out["past_key_values"]
            keyword = "cache" if "cache" in out.keys() else "past_key_values"
            model(input_ids=ids[:, -1:], attention_mask=mask, use_cache=True, **{keyword: cache})  # stale mask
        print(json.dumps([neofix.is_patched(), [type(w.message).__name__ for w in caught]]))
        """
    )
    assert out[0] is True
    assert "NeofixWarning" in out[1]


def test_neofix_disable_registers_nothing():
    out, _ = run_python(
        """
        import json, neofix
        from transformers import GPTNeoForCausalLM
        print(json.dumps(neofix.is_patched()))
        """,
        NEOFIX_DISABLE="1",
    )
    assert out is False


@pytest.mark.parametrize(
    "value, expected, warned",
    [("strict", "strict", False), ("repair", "repair", False), ("bogus", "repair", True)],
)
def test_neofix_mode_environment(value, expected, warned):
    out, stderr = run_python(
        """
        import json, neofix
        print(json.dumps(neofix.configure()["mode"]))
        """,
        NEOFIX_MODE=value,
    )
    assert out == expected
    assert ("NEOFIX_MODE='bogus' is not one of" in stderr) is warned


def test_import_never_crashes_without_transformers():
    out, stderr = run_python(
        """
        import json, sys
        sys.modules["transformers"] = None  # as if transformers were not installed
        import neofix
        print(json.dumps([neofix.is_patched(), neofix.patch()]))
        """
    )
    assert out == [False, False]
    assert "could not import transformers.models.gpt_neo.modeling_gpt_neo" in stderr


def test_import_never_crashes_on_unsupported_transformers():
    out, stderr = run_python(
        """
        import json
        import neofix
        from neofix import _compat  # imports transformers, not its GPT-Neo module
        _compat.transformers_version = lambda: "99.0.0"
        from transformers import GPTNeoForCausalLM
        print(json.dumps(neofix.is_patched()))
        """
    )
    assert out is False
    assert "transformers 99.0.0 is outside the tested range" in stderr


def test_configure_validates_and_restores():
    previous = neofix.configure(mode="strict", check_values=True, uncached_positions="transformers")
    assert previous == {"mode": "repair", "check_values": False, "uncached_positions": "mask"}
    assert neofix.configure(**previous) == {
        "mode": "strict",
        "check_values": True,
        "uncached_positions": "transformers",
    }
    with pytest.raises(ValueError, match="mode must be one of"):
        neofix.configure(mode="lenient")
    with pytest.raises(ValueError, match="check_values must be True or False"):
        neofix.configure(check_values="yes")
    with pytest.raises(ValueError, match=r"uncached_positions='vanilla'\): must be one of \('mask', 'transformers'\)"):
        neofix.configure(uncached_positions="vanilla")
    assert neofix.configure() == previous


def test_public_surface():
    assert issubclass(neofix.NeofixError, ValueError)
    assert issubclass(neofix.NeofixWarning, UserWarning)
    for name in neofix.__all__:
        assert getattr(neofix, name) is not None


# -- neofix.patched() / neofix.unpatched() -----------------------------------------------------------------------------


def _stale_mask_step(model):
    """One decode step that keeps the prompt's mask: neofix repairs it (with a warning), vanilla does not."""
    import torch

    from ._versions import cache_keyword, output_cache

    ids = torch.tensor([[5, 6, 7]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        return model(input_ids=torch.tensor([[8]]), attention_mask=mask, **{cache_keyword(): output_cache(out)})


def test_patch_before_transformers_is_loaded_wraps_once():
    """``neofix.patch()`` before transformers is imported imports GPT-Neo's module, whose import hook patches it
    right then: patch() sees that and wraps nothing a second time, so one unpatch() gives vanilla back."""
    out, _ = run_python(
        """
        import json

        import neofix

        installed = neofix.patch()
        from transformers.models.gpt_neo import modeling_gpt_neo

        forward = modeling_gpt_neo.GPTNeoModel.forward
        print(json.dumps({
            "installed": installed,
            "wrapper": hasattr(forward, "__neofix_wrapper__"),
            "of_a_wrapper": hasattr(forward.__wrapped__, "__neofix_wrapper__"),
            "again": neofix.patch(),
            "removed": neofix.unpatch(),
            "vanilla_after": not hasattr(modeling_gpt_neo.GPTNeoModel.forward, "__neofix_wrapper__"),
        }))
        """
    )
    assert out == {
        "installed": True, "wrapper": True, "of_a_wrapper": False, "again": False, "removed": True,
        "vanilla_after": True,
    }


def test_a_family_first_loaded_inside_an_unpatched_block_is_patched_after_it():
    """The import hooks are off inside the block; on exit neofix is back, so a family whose module was first loaded
    there is patched as its hook would have patched it, and nothing else is imported.  One loaded after the block is
    patched by its hook, and a family not named by ``NEOFIX_FAMILIES`` stays alone."""
    out, _ = run_python(
        """
        import json
        import sys

        import neofix

        with neofix.unpatched():
            from transformers.models.gpt2 import modeling_gpt2
            from transformers.models.gptj import modeling_gptj
            inside = [hasattr(modeling_gpt2.GPT2Model.forward, "__neofix_wrapper__"),
                      hasattr(modeling_gptj.GPTJModel.forward, "__neofix_wrapper__")]
        gpt_neo_loaded = "transformers.models.gpt_neo.modeling_gpt_neo" in sys.modules
        from transformers.models.gpt_neo import modeling_gpt_neo
        print(json.dumps({
            "inside": inside,
            "gpt_neo_loaded_by_the_block": gpt_neo_loaded,
            "gpt2": hasattr(modeling_gpt2.GPT2Model.forward, "__neofix_wrapper__"),
            "gptj": hasattr(modeling_gptj.GPTJModel.forward, "__neofix_wrapper__"),
            "gpt_neo": hasattr(modeling_gpt_neo.GPTNeoModel.forward, "__neofix_wrapper__"),
        }))
        """,
        NEOFIX_FAMILIES="gpt_neo,gpt2",
    )
    assert out == {
        "inside": [False, False], "gpt_neo_loaded_by_the_block": False, "gpt2": True, "gptj": False, "gpt_neo": True
    }


def test_a_block_over_an_unpatched_neofix_patches_nothing_loaded_in_it():
    """After ``neofix.unpatch()`` the hooks are off: a family loaded inside a ``patched()`` or ``unpatched()`` block
    is left unpatched after it, as before the block."""
    out, _ = run_python(
        """
        import json
        import neofix

        neofix.unpatch()
        with neofix.unpatched():
            from transformers.models.gpt2 import modeling_gpt2
        with neofix.patched():
            from transformers.models.gptj import modeling_gptj
        print(json.dumps({
            "gpt2": hasattr(modeling_gpt2.GPT2Model.forward, "__neofix_wrapper__"),
            "gptj": hasattr(modeling_gptj.GPTJModel.forward, "__neofix_wrapper__"),
            "patched": neofix.is_patched(),
        }))
        """
    )
    assert out == {"gpt2": False, "gptj": False, "patched": False}


def test_unpatched_block_runs_vanilla_and_restores_everything(model):
    patched_attributes = class_attributes()
    with pytest.warns(neofix.NeofixWarning, match="extended it with ones"):
        _stale_mask_step(model)  # the repair is reported once...
    with neofix.unpatched():
        assert not neofix.is_patched()
        assert class_attributes() != patched_attributes
        _lifecycle._on_import(modeling_gpt_neo)  # the import hook stays off inside the block
        assert not neofix.is_patched()
    assert neofix.is_patched()
    assert class_attributes() == patched_attributes  # the very same wrappers are back
    with warnings.catch_warnings():
        warnings.simplefilter("error", neofix.NeofixWarning)
        _stale_mask_step(model)  # ...and stays reported: the block kept what was already said


def test_patched_block_puts_back_the_unpatched_state_and_what_it_reported(model):
    neofix.unpatch()
    before = class_attributes()
    with neofix.patched():
        assert neofix.is_patched()
        with pytest.warns(neofix.NeofixWarning, match="extended it with ones"):
            _stale_mask_step(model)
    assert not neofix.is_patched()
    assert class_attributes() == before
    assert not _lifecycle._hooks_enabled  # as unpatch() left it
    neofix.patch()
    with pytest.warns(neofix.NeofixWarning, match="extended it with ones"):  # forgotten on exit: reported again
        _stale_mask_step(model)


def test_blocks_restore_on_error_and_nest():
    with pytest.raises(KeyError):
        with neofix.unpatched():
            with neofix.patched():
                assert neofix.is_patched()
            assert not neofix.is_patched()
            raise KeyError("inside")
    assert neofix.is_patched()


def test_unpatch_refuses_when_another_library_wrapped_over_neofix():
    """Removing neofix's wrapper would drop the other library's too: unpatch changes nothing and says which, the
    import hooks included (a family transformers loads afterwards is still patched when it does)."""
    import functools

    assert _lifecycle._hooks_enabled
    cls = modeling_gpt_neo.GPTNeoModel
    ours = vars(cls)["forward"]

    @functools.wraps(ours)
    def theirs(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    cls.forward = theirs
    try:
        patched_attributes = class_attributes()
        with pytest.warns(neofix.NeofixWarning, match=r"cannot unpatch: GPTNeoModel\.forward was wrapped again"):
            assert neofix.unpatch() is False
        assert neofix.is_patched()
        assert class_attributes() == patched_attributes  # nothing changed, the other targets included
        assert _lifecycle._hooks_enabled  # the import hooks still patch a family transformers loads from now on
        assert neofix.patch() is False  # still patched: nothing is wrapped twice
        assert vars(cls)["forward"] is theirs
        with pytest.raises(RuntimeError, match="cannot be removed"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", neofix.NeofixWarning)
                with neofix.unpatched():
                    pass  # pragma: no cover
        assert neofix.is_patched()
    finally:
        cls.forward = ours
    assert neofix.unpatch() is True  # with the outer wrapper gone, unpatch is exact again
    assert "forward" not in vars(cls) or not hasattr(vars(cls)["forward"], "__neofix_wrapper__")


# -- which families are patched -----------------------------------------------------------------------------------------


def test_patch_takes_the_families_to_patch():
    assert neofix.FAMILIES[0] == "gpt_neo" and len(set(neofix.FAMILIES)) == len(neofix.FAMILIES)
    neofix.unpatch()
    try:
        assert neofix.patch(families=[]) is False  # none named: nothing patched
        assert not neofix.is_patched()
        rows = {name: (state, reason) for name, state, reason in _lifecycle.status()}
        assert rows["GPTNeoModel.forward"][0] == "unpatched"
        assert "GPT-Neo is not among the families patched" in rows["GPTNeoModel.forward"][1]
        _lifecycle._on_import(modeling_gpt_neo)  # the import hook leaves a family not named alone too
        assert not neofix.is_patched()
        assert neofix.patch(families="gpt_neo") is True  # a comma-separated string works as well
        assert neofix.is_patched()
    finally:
        neofix.patch(families=neofix.FAMILIES)
    with pytest.raises(ValueError, match=r"unknown model family \['gpt5'\]; choose from \[.*'gpt_neo'"):
        neofix.patch(families=["gpt_neo", "gpt5"])


def test_neofix_families_environment():
    out, _ = run_python(
        """
        import json, neofix
        from transformers import GPTNeoForCausalLM
        print(json.dumps(neofix.is_patched()))
        """,
        NEOFIX_FAMILIES="gpt_neo",
    )
    assert out is True
    out, err = run_python(
        """
        import json, neofix
        from transformers import GPTNeoForCausalLM
        print(json.dumps(neofix.is_patched()))
        """,
        NEOFIX_FAMILIES="gpt_neo,nonsense",
    )
    assert out is True  # an unknown name is said, and every family patched
    assert "NEOFIX_FAMILIES='gpt_neo,nonsense': unknown model family ['nonsense']" in err


def test_a_warning_points_at_the_callers_line(monkeypatch):
    """A NeofixWarning of ``patch()`` names the caller's line, not neofix's."""
    from neofix import _compat

    neofix.unpatch()
    monkeypatch.setattr(_compat, "transformers_version", lambda: "4.20.0")
    with pytest.warns(neofix.NeofixWarning, match="is outside the tested range") as caught:
        neofix.patch()
    # one warning per family whose module is loaded (more after other tests loaded them), each at this line
    assert caught and {warning.filename for warning in caught} == {__file__}


# -- register(): what ``import neofix`` does, in this process --------------------------------------------------------


@pytest.fixture
def registering(monkeypatch):
    """The state ``import neofix`` registers from: nothing patched, the import hooks on, every family enabled, no
    NEOFIX_ variable set, and one family's modeling module not loaded yet (hidden from ``sys.modules``); the finders
    ``register()`` adds to ``sys.meta_path`` are removed afterwards.  Yields the hidden module's name and
    ``sys.meta_path`` as it was."""
    for name in [name for name in os.environ if name.startswith("NEOFIX_")]:
        monkeypatch.delenv(name)
    neofix.unpatch()
    monkeypatch.setattr(_lifecycle, "_hooks_enabled", True)
    monkeypatch.setattr(_lifecycle, "_enabled", frozenset(FAMILIES))
    hidden = FAMILIES["bloom"].module
    monkeypatch.delitem(sys.modules, hidden, raising=False)
    before = list(sys.meta_path)
    yield hidden, before
    sys.meta_path[:] = [f for f in sys.meta_path if f in before or not isinstance(f, _lifecycle._ModuleWatcher)]


@pytest.mark.parametrize("value", ["1", "true", "Yes", " ON "])
def test_neofix_disable_registers_no_hook(registering, monkeypatch, value):
    """NEOFIX_DISABLE (any of 1/true/yes/on, any case): ``import neofix`` patches no loaded module and waits for no
    other."""
    monkeypatch.setenv("NEOFIX_DISABLE", value)
    _lifecycle.register()
    assert not neofix.is_patched()
    assert sys.meta_path == registering[1]
    rows = _lifecycle.status()
    assert {state for _, state, _ in rows} <= {"unpatched", "pending", "skipped"}
    # skipped: only the targets of families this release does not have (Qwen3 on 4.45)
    assert all(reason.startswith("not needed on transformers") for _, state, reason in rows if state == "skipped")


def test_neofix_disable_not_understood_is_warned_and_patches(registering, monkeypatch):
    """NEOFIX_DISABLE=yesplease was read as "not disabled" without a word, though an invalid value is documented as
    warned: it is named whole, and neofix patches as without it."""
    monkeypatch.setenv("NEOFIX_DISABLE", "yesplease")
    with pytest.warns(neofix.NeofixWarning) as caught:
        _lifecycle.register()
    assert [str(warning.message) for warning in caught] == [
        "NEOFIX_DISABLE='yesplease' is not a boolean (1/0, true/false); using 0"
    ]
    assert _lifecycle._applied.get("gpt_neo")


def test_a_failing_registration_is_a_warning_that_names_every_family(monkeypatch):
    """``import neofix`` never crashes: a registration that raises is a warning (it named only GPT-Neo, though every
    family is registered there), saying where to see what was patched."""

    def failing() -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(_lifecycle, "register", failing)
    with pytest.warns(neofix.NeofixWarning) as caught:
        neofix._register()
    assert [str(warning.message) for warning in caught] == [
        "neofix: registering its patches failed (RuntimeError: boom); the families not patched by then stay unpatched "
        "(`neofix doctor` lists each patch target's state)"
    ]


def test_register_patches_the_loaded_modules_at_once_and_waits_first_for_the_others(registering, monkeypatch):
    """A loaded family's module is patched as ``import neofix`` registers; one not loaded yet is waited for by a
    finder placed first in ``sys.meta_path``, ahead of every finder that could load it."""
    monkeypatch.setenv("NEOFIX_DISABLE", "0")
    _lifecycle.register()
    assert _lifecycle._applied.get("gpt_neo")
    rows = {name: state for name, state, _ in _lifecycle.status()}
    assert rows["GPTNeoModel.forward"] == "patched"
    watcher = sys.meta_path[0]
    assert isinstance(watcher, _lifecycle._ModuleWatcher)
    assert registering[0] in watcher.waiting
    assert not watcher.waiting & {family.module for family in FAMILIES.values() if family.module in sys.modules}


def test_neofix_families_chooses_what_register_patches(registering, monkeypatch):
    """NEOFIX_FAMILIES=gpt2: the loaded GPT-Neo is left alone, by the import hook and by a later ``patch()``."""
    monkeypatch.setenv("NEOFIX_FAMILIES", " gpt2 ")
    _lifecycle.register()
    assert not _lifecycle._applied.get("gpt_neo")
    neofix.patch()
    assert not _lifecycle._applied.get("gpt_neo")
    state, reason = {name: (state, reason) for name, state, reason in _lifecycle.status()}["GPTNeoModel.forward"]
    assert (state, reason) == (
        "unpatched", "GPT-Neo is not among the families patched (NEOFIX_FAMILIES or neofix.patch(families=...))"
    )


def test_unpatch_names_every_method_wrapped_over_neofix():
    """Two methods wrapped again by another library: both are named, with the plural."""
    import functools

    owners = (modeling_gpt_neo.GPTNeoModel, "forward"), (modeling_gpt_neo.GPTNeoForCausalLM, "generate")
    ours = [vars(cls)[name] for cls, name in owners]
    for (cls, name), method in zip(owners, ours):
        setattr(cls, name, functools.wraps(method)(lambda self, *a, _method=method, **k: _method(self, *a, **k)))
    try:
        with pytest.warns(neofix.NeofixWarning) as caught:
            assert neofix.unpatch() is False
        message = str(caught[0].message)
        assert message.startswith(
            "neofix: cannot unpatch: GPTNeoModel.forward, GPTNeoForCausalLM.generate were wrapped again "
        ), message
    finally:
        for (cls, name), method in zip(owners, ours):
            setattr(cls, name, method)
    assert neofix.unpatch() is True
    neofix.patch()


def test_families_named_in_a_string_and_the_unknown_ones_named():
    """``families`` as one comma-separated string (spaces allowed) patches each; several unknown names are all named,
    with the plural, after where they were given."""
    neofix.unpatch()
    try:
        assert neofix.patch(families=" gpt_neo, gpt2 ,") is True
        assert _lifecycle._enabled == {"gpt_neo", "gpt2"} and _lifecycle._applied.get("gpt_neo")
    finally:
        neofix.patch(families=neofix.FAMILIES)
    with pytest.raises(ValueError) as raised:
        neofix.patch(families="gpt6,gpt5")
    assert str(raised.value) == (
        f"neofix.patch(families=...): unknown model families ['gpt5', 'gpt6']; choose from {sorted(FAMILIES)}"
    )


def test_status_of_a_loaded_family_while_unpatched():
    """Every target of a loaded family, while neofix is not applied: "unpatched", "neofix is not applied"."""
    neofix.unpatch()
    try:
        rows = {name: (state, reason) for name, state, reason in _lifecycle.status()}
        assert rows["GPTNeoModel.forward"] == ("unpatched", "neofix is not applied")
        assert rows["GPTNeoForCausalLM.generate"] == ("unpatched", "neofix is not applied")
    finally:
        neofix.patch()


def test_status_rows_of_a_patched_gpt_neo_whole():
    """Each GPT-Neo target's row, whole: a method the class defines is "patched" on this release, one it inherits
    adds that the wrapper went on the class; a target with nothing to do says why, and a module-level helper the
    release lacks is named after its module."""
    from neofix import _compat

    version = _compat.transformers_version()
    cls = modeling_gpt_neo.GPTNeoForCausalLM
    neofix.unpatch()
    own = {name: name in vars(cls) for name in ("prepare_inputs_for_generation", "generate", "_get_stopping_criteria")}
    assert neofix.patch() is True
    rows = {name: (state, reason) for name, state, reason in _lifecycle.status()}
    for name, defined in own.items():
        note = "" if defined else " (inherited; wrapper installed on the class)"
        assert rows[f"GPTNeoForCausalLM.{name}"] == ("patched", f"transformers {version}{note}"), name
    assert rows["GPTNeoModel.forward"] == ("patched", f"transformers {version}")
    assert rows["GPTNeoSelfAttention.forward"] == (
        ("patched", f"transformers {version}")
        if has("attention layers get the whole cache")
        else (
            "skipped",
            f"not needed on transformers {version}: before 4.45 GPT-Neo's attention layers take no cache object, so "
            f"no static cache reaches them",
        )
    )
    if not hasattr(modeling_gpt_neo, "GPTNeoFlashAttention2"):  # transformers < 4.36
        assert rows["GPTNeoFlashAttention2.forward"] == (
            "skipped", "not needed: this release has no GPTNeoFlashAttention2.forward"
        )
    helper = "modeling_gpt_neo._prepare_4d_causal_attention_mask"
    if not hasattr(modeling_gpt_neo, "_prepare_4d_causal_attention_mask"):  # only 4.36 - 4.44 import it
        assert rows[helper] == (
            "skipped",
            "not needed: this release has no transformers.models.gpt_neo.modeling_gpt_neo._prepare_4d_causal_attention_mask",
        )
    else:
        assert rows[helper][0] in ("patched", "skipped")


def test_a_target_outside_its_releases_is_left_as_it_is(monkeypatch):
    """A target gated to some releases is wrapped only inside them; outside, it is left as it is and its row says
    why: the target's own reason (GPT-Neo's float64 mask helper, needed from 4.36 to below 4.45), else the releases
    (the flash-attention forward, from 4.36).  unpatch() puts the very same objects back."""
    from neofix import _compat

    def helper(*args, **kwargs):
        pass  # pragma: no cover

    class Flash:
        def forward(self, *args, **kwargs):
            pass  # pragma: no cover

    flash_forward = vars(Flash)["forward"]
    wrappers = set()
    neofix.unpatch()
    monkeypatch.setattr(modeling_gpt_neo, "_prepare_4d_causal_attention_mask", helper, raising=False)
    monkeypatch.setattr(modeling_gpt_neo, "GPTNeoFlashAttention2", Flash, raising=False)
    why = "only transformers 4.36 - 4.44 build GPT-Neo's causal mask through this helper, which overflows in float64"
    for version, helper_row, flash_row in (
        ("4.35.2", ("skipped", f"not needed on transformers 4.35.2: {why}"),
         ("skipped", "not needed on transformers 4.35.2: only transformers 4.36 and later have it")),
        ("4.36.0", ("patched", "transformers 4.36.0"), ("patched", "transformers 4.36.0")),
        ("4.44.2", ("patched", "transformers 4.44.2"), ("patched", "transformers 4.44.2")),
        ("4.45.0", ("skipped", f"not needed on transformers 4.45.0: {why}"), ("patched", "transformers 4.45.0")),
    ):
        monkeypatch.setattr(_compat, "transformers_version", lambda version=version: version)
        assert neofix.patch() is True
        rows = {name: (state, reason) for name, state, reason in _lifecycle.status()}
        assert rows["modeling_gpt_neo._prepare_4d_causal_attention_mask"] == helper_row, version
        assert rows["GPTNeoFlashAttention2.forward"] == flash_row, version
        assert (modeling_gpt_neo._prepare_4d_causal_attention_mask is helper) is (helper_row[0] == "skipped")
        assert (vars(Flash)["forward"] is flash_forward) is (flash_row[0] == "skipped")
        if flash_row[0] == "patched":  # a wrapper of the original, the very same one each time it is patched
            assert vars(Flash)["forward"].__wrapped__ is flash_forward
            wrappers.add(vars(Flash)["forward"])
        assert neofix.unpatch() is True
        assert modeling_gpt_neo._prepare_4d_causal_attention_mask is helper and vars(Flash)["forward"] is flash_forward
    assert len(wrappers) == 1


@pytest.mark.parametrize(
    ("since", "until", "words"),
    [
        ("4.36", None, "only transformers 4.36 and later have it"),
        (None, "4.45", "only below 4.45"),
        ("4.36", "4.45", "only transformers 4.36 to below 4.45 need it"),
    ],
)
def test_a_gated_target_without_a_reason_is_skipped_with_its_releases(since, until, words):
    """A target given no ``why`` names the releases it is for (GPT-Neo's gated targets are of the first kind, or
    carry their own reason; a family adapter may declare any of the three)."""
    from neofix._families import Target

    target = Target("GPTNeoModel", "forward", wrapper="make_model_forward", since=since, until=until)
    assert _lifecycle._gate(target) == words


def test_unsupported_transformers_rows_say_why(monkeypatch):
    """On a transformers outside the supported range every target of the family is "skipped", with the range."""
    from neofix import _compat

    neofix.unpatch()
    monkeypatch.setattr(_compat, "transformers_version", lambda: "4.20.0")
    with pytest.warns(neofix.NeofixWarning):
        assert neofix.patch() is False
    rows = {name: (state, reason) for name, state, reason in _lifecycle.status()}
    for target in FAMILIES["gpt_neo"].targets:
        assert rows[_lifecycle.target_name(FAMILIES["gpt_neo"], target)] == (
            "skipped", "transformers 4.20.0 is outside >=4.26,<6"
        )


def test_patch_reaches_every_loaded_family_named(monkeypatch):
    """``patch(families=...)`` patches each named family whose module is loaded, whatever comes before it in
    ``neofix.FAMILIES``: a family not named (GPT-Neo), one patched already (GPT-2), one not loaded yet (GPT-J, left
    pending) are passed over, not stopped at."""
    import importlib

    from neofix import _compat

    for name in ("gpt2", "bloom"):
        importlib.import_module(FAMILIES[name].module)
    neofix.unpatch()
    monkeypatch.delitem(sys.modules, FAMILIES["gptj"].module, raising=False)
    try:
        assert neofix.patch(families=["gpt2"]) is True
        assert {name for name, applied in _lifecycle._applied.items() if applied} == {"gpt2"}
        assert neofix.patch(families=["gpt2", "gptj", "bloom"]) is True
        assert {name for name, applied in _lifecycle._applied.items() if applied} == {"gpt2", "bloom"}
        rows = {name: (state, reason) for name, state, reason in _lifecycle.status()}
        assert rows["GPTJModel.forward"] == ("pending", "patched when transformers loads modeling_gptj")
        assert rows["BloomModel.forward"] == ("patched", f"transformers {_compat.transformers_version()}")
        assert rows["GPTNeoModel.forward"] == (
            "unpatched", "GPT-Neo is not among the families patched (NEOFIX_FAMILIES or neofix.patch(families=...))"
        )
    finally:
        neofix.unpatch()
        neofix.patch(families=neofix.FAMILIES)


def test_environment_settings_applied_and_bad_values_named():
    """What ``import neofix`` reads from NEOFIX_MODE, NEOFIX_CHECK_VALUES, NEOFIX_UNCACHED_POSITIONS (and NEOFIX_TRACE's
    warning): any case,
    spaces around; an empty choice counts as unset, an empty boolean as false; a value not understood is named
    whole, with the default used, and changes nothing."""
    from neofix import _config

    settings = _config.settings

    def current():
        return settings.mode, settings.strict, settings.check_values, settings.uncached_positions

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", neofix.NeofixWarning)
            _config.load_environment(
                {"NEOFIX_MODE": " Strict ", "NEOFIX_CHECK_VALUES": "YES", "NEOFIX_UNCACHED_POSITIONS": "Transformers"}
            )
            assert current() == ("strict", True, True, "transformers")
            _config.load_environment({"NEOFIX_MODE": "", "NEOFIX_UNCACHED_POSITIONS": "  "})
            assert current() == ("strict", True, True, "transformers")
            _config.load_environment({"NEOFIX_MODE": "repair", "NEOFIX_CHECK_VALUES": "", "NEOFIX_UNCACHED_POSITIONS": "mask"})
            assert current() == ("repair", False, False, "mask")
            _config.load_environment({"NEOFIX_CHECK_VALUES": " On "})
            assert current() == ("repair", False, True, "mask")
            _config.load_environment({"NEOFIX_CHECK_VALUES": "off"})
            assert current() == ("repair", False, False, "mask")
        with pytest.warns(neofix.NeofixWarning) as caught:
            _config.load_environment(
                {
                    "NEOFIX_MODE": "lenient",
                    "NEOFIX_CHECK_VALUES": "maybe",
                    "NEOFIX_UNCACHED_POSITIONS": " vanilla",
                    "NEOFIX_TRACE": "banana",
                }
            )
        assert [str(warning.message) for warning in caught] == [
            "NEOFIX_MODE='lenient' is not one of ('repair', 'strict'); using 'repair'",
            "NEOFIX_CHECK_VALUES='maybe' is not a boolean (1/0, true/false); using 0",
            "NEOFIX_UNCACHED_POSITIONS=' vanilla' is not one of ('mask', 'transformers'); using 'mask'",
            "NEOFIX_TRACE='banana' is not a boolean (1/0, true/false); using 0",
        ]
        assert current() == ("repair", False, False, "mask") and settings.log_steps is False
    finally:
        neofix.configure(mode="repair", check_values=False, uncached_positions="mask")


def test_settings_start_at_the_documented_defaults():
    """Without NEOFIX_ variables neofix starts in repair mode, without value checks on decode steps, with uncached
    positions from the mask and no step log."""
    from neofix import _config

    fresh = _config._Settings()
    assert (fresh.mode, fresh.strict, fresh.check_values, fresh.uncached_positions, fresh.log_steps) == (
        "repair", False, False, "mask", False
    )
    assert fresh.strict is False and fresh.check_values is False and fresh.log_steps is False


def test_the_watcher_hands_the_first_lookup_of_a_waited_module_to_wrapt(tmp_path, monkeypatch):
    """The finder ``import neofix`` places first in ``sys.meta_path``: the first lookup of a module it waits for
    registers wrapt's post-import hook and answers with what wrapt's finder answers (the module's spec, loaded through
    wrapt so that the hook runs), even with another finder between them; any other lookup, and a second one, it leaves
    to the finders after it."""
    import importlib.machinery
    import uuid

    name = f"neofix_watched_probe_{uuid.uuid4().hex}"  # a name wrapt has no hook for yet
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    watcher = _lifecycle._ModuleWatcher([name, "neofix_other_probe"])
    monkeypatch.setattr(sys, "meta_path", [watcher, importlib.machinery.PathFinder, *sys.meta_path])
    assert watcher.find_spec("json") is None
    spec = watcher.find_spec(name, None, None)
    assert spec is not None and spec.name == name and spec.origin == str(tmp_path / f"{name}.py")
    assert type(spec.loader).__module__.startswith("wrapt"), spec.loader
    assert watcher.waiting == {"neofix_other_probe"}
    assert watcher.find_spec(name) is None


def test_register_reads_neofix_families_whole(registering, monkeypatch):
    """``import neofix``: no NEOFIX_ variable, no warning and every family enabled; NEOFIX_FAMILIES naming a family
    after others waits for that one alone; an unknown name is said whole and every family patched.  NEOFIX_DISABLE:
    a loaded family's rows say neofix is not applied, one not loaded yet is pending."""
    hidden, before = registering
    with warnings.catch_warnings():
        warnings.simplefilter("error", neofix.NeofixWarning)
        _lifecycle.register()
    assert _lifecycle._enabled == frozenset(FAMILIES) and _lifecycle._applied.get("gpt_neo")
    neofix.unpatch()
    sys.meta_path[:] = before
    monkeypatch.setattr(_lifecycle, "_hooks_enabled", True)
    monkeypatch.setenv("NEOFIX_FAMILIES", "bloom")
    _lifecycle.register()
    assert _lifecycle._enabled == {"bloom"} and not _lifecycle.is_patched()
    assert isinstance(sys.meta_path[0], _lifecycle._ModuleWatcher) and sys.meta_path[0].waiting == {hidden}
    sys.meta_path[:] = before
    monkeypatch.setattr(_lifecycle, "_enabled", frozenset(FAMILIES))
    monkeypatch.setenv("NEOFIX_FAMILIES", "gpt_neo,nonsense")
    with pytest.warns(neofix.NeofixWarning) as caught:
        _lifecycle.register()
    assert [str(warning.message) for warning in caught] == [
        f"NEOFIX_FAMILIES='gpt_neo,nonsense': unknown model family ['nonsense']; choose from {sorted(FAMILIES)}; "
        f"patching every family"
    ]
    assert _lifecycle._enabled == frozenset(FAMILIES)
    neofix.unpatch()
    sys.meta_path[:] = before
    monkeypatch.setattr(_lifecycle, "_hooks_enabled", True)
    monkeypatch.delenv("NEOFIX_FAMILIES")
    monkeypatch.setenv("NEOFIX_DISABLE", "1")
    _lifecycle.register()
    rows = {name: (state, reason) for name, state, reason in _lifecycle.status()}
    assert rows["GPTNeoModel.forward"] == ("unpatched", "neofix is not applied")
    assert rows["BloomModel.forward"] == ("pending", "patched when transformers loads modeling_bloom")


def test_the_hook_firing_again_changes_nothing():
    """GPT-Neo's post-import hook running again while it is patched (a module re-imported) wraps nothing twice:
    the same wrappers stay, and unpatch() still restores transformers exactly."""
    patched_attributes = class_attributes()
    neofix.unpatch()
    vanilla = class_attributes()
    neofix.patch()
    _lifecycle._on_import(modeling_gpt_neo)
    assert class_attributes() == patched_attributes
    assert neofix.unpatch() is True
    assert class_attributes() == vanilla


def test_unpatched_refuses_whole_when_another_library_wrapped_over_neofix():
    """``with neofix.unpatched():`` over another library's wrapper raises, with the whole reason, and leaves neofix
    patched."""
    import functools

    cls = modeling_gpt_neo.GPTNeoModel
    ours = vars(cls)["forward"]
    cls.forward = functools.wraps(ours)(lambda self, *args, **kwargs: ours(self, *args, **kwargs))
    try:
        with pytest.raises(RuntimeError) as raised:
            with neofix.unpatched():
                pass  # pragma: no cover
        assert str(raised.value) == (
            "neofix.unpatched(): neofix cannot be removed, because another library wrapped one of the attributes it "
            "patched after it did (neofix.unpatch() says which)"
        )
        assert neofix.is_patched()
    finally:
        cls.forward = ours
