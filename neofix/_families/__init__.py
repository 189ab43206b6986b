"""The model families neofix patches, declared: each one's modeling module and the attributes neofix replaces there.

Importing this package imports neither torch nor transformers (``import neofix`` reads it to register its import
hooks).  A family's adapter (the part that reads its forward's arguments, config and cache) lives in a module of
this package imported only when the family's modeling module is loaded.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time
if TYPE_CHECKING:
    from typing import Any


class Target:
    """One attribute neofix replaces (or, with ``wrapper=""``, deliberately leaves alone: the doctor says why).

    ``owner`` is a class of the family's modeling module ("" for the module itself); ``wrapper`` the name of the
    factory in :mod:`neofix._wrappers` that receives the original and returns its replacement.  ``since`` /
    ``until`` gate it to transformers releases (``until`` exclusive); outside them it is skipped with ``why``.
    A ``required`` target missing from an in-range release is warned about; an optional one is skipped.
    """

    __slots__ = ("attribute", "name", "owner", "required", "since", "until", "why", "wrapper")

    def __init__(
        self,
        owner: str,
        attribute: str,
        *,
        wrapper: str,
        required: bool = False,
        since: str | None = None,
        until: str | None = None,
        why: str = "",
    ) -> None:
        self.owner, self.attribute, self.wrapper = owner, attribute, wrapper
        self.required, self.since, self.until, self.why = required, since, until, why
        self.name = f"{owner}.{attribute}" if owner else attribute

    def __repr__(self) -> str:
        return f"Target({self.name!r})"


class Family:
    """A model family: its name, its modeling module, its base model class and its patch targets."""

    __slots__ = ("adapter", "base_model", "causal_lm", "module", "name", "targets", "title")

    def __init__(
        self,
        name: str,
        title: str,
        module: str,
        base_model: str,
        causal_lm: str,
        adapter: str,
        targets: tuple[Target, ...],
    ) -> None:
        self.name, self.title, self.module = name, title, module
        self.base_model, self.causal_lm, self.adapter, self.targets = base_model, causal_lm, adapter, targets

    def __repr__(self) -> str:
        return f"Family({self.name!r})"

    def load_adapter(self) -> Any:
        """The family's adapter module (imports torch and transformers)."""
        import importlib

        return importlib.import_module(self.adapter)


GPT_NEO = Family(
    "gpt_neo",
    "GPT-Neo",
    "transformers.models.gpt_neo.modeling_gpt_neo",
    "GPTNeoModel",
    "GPTNeoForCausalLM",
    "neofix._families.gpt_neo",
    (
        Target("GPTNeoModel", "forward", wrapper="make_model_forward", required=True),
        Target(
            "GPTNeoForCausalLM",
            "prepare_inputs_for_generation",
            wrapper="make_prepare_inputs_for_generation",
            required=True,
        ),
        Target("GPTNeoForCausalLM", "generate", wrapper="make_generate", required=True),
        Target("GPTNeoForCausalLM", "_get_stopping_criteria", wrapper="make_get_stopping_criteria", required=True),
        Target(
            "GPTNeoSelfAttention",
            "forward",
            wrapper="",
            why="GPTNeoModel.forward reads every layer's cache length and refuses an uneven cache before any layer "
            "runs, so the eager attention layers need no check of their own",
        ),
        Target("GPTNeoFlashAttention2", "forward", wrapper="make_flash_attention_forward", since="4.36"),
        Target(
            "",
            "_prepare_4d_causal_attention_mask",
            wrapper="make_prepare_4d_mask_for_float64",
            since="4.36",
            until="4.45",
            why="only transformers 4.36 - 4.44 build GPT-Neo's causal mask through this helper, which overflows in "
            "float64",
        ),
    ),
)



def _generate_targets(causal_lm: str, *, stopping: bool = True) -> tuple[Target, ...]:
    """``generate``'s entry points on a causal LM: its input preparation, ``generate`` itself and (where the family
    has a position table that generate can run past) the stopping criteria, which neofix makes stop at the table."""
    targets = (
        Target(causal_lm, "prepare_inputs_for_generation", wrapper="make_prepare_inputs_for_generation", required=True),
        Target(causal_lm, "generate", wrapper="make_generate", required=True),
    )
    if stopping:
        targets += (Target(causal_lm, "_get_stopping_criteria", wrapper="make_get_stopping_criteria", required=True),)
    return targets


GPT2 = Family(
    "gpt2",
    "GPT-2",
    "transformers.models.gpt2.modeling_gpt2",
    "GPT2Model",
    "GPT2LMHeadModel",
    "neofix._families.gpt2",
    (
        Target("GPT2Model", "forward", wrapper="make_model_forward", required=True),
        *_generate_targets("GPT2LMHeadModel"),
        Target(
            "",
            "_prepare_4d_causal_attention_mask_for_sdpa",
            wrapper="make_prepare_4d_mask_in_float64",
            since="4.42",
            until="4.52",
            why="only transformers 4.42 - 4.51 build GPT-2's causal mask (sdpa attention, the default) through this "
            "helper, which overflows in float64",
        ),
    ),
)

GPTJ = Family(
    "gptj",
    "GPT-J",
    "transformers.models.gptj.modeling_gptj",
    "GPTJModel",
    "GPTJForCausalLM",
    "neofix._families.gptj",
    (Target("GPTJModel", "forward", wrapper="make_model_forward", required=True), *_generate_targets("GPTJForCausalLM")),
)

CODEGEN = Family(
    "codegen",
    "CodeGen",
    "transformers.models.codegen.modeling_codegen",
    "CodeGenModel",
    "CodeGenForCausalLM",
    "neofix._families.codegen",
    (
        Target("CodeGenModel", "forward", wrapper="make_model_forward", required=True),
        *_generate_targets("CodeGenForCausalLM"),
    ),
)

GPT_NEOX = Family(
    "gpt_neox",
    "GPT-NeoX",
    "transformers.models.gpt_neox.modeling_gpt_neox",
    "GPTNeoXModel",
    "GPTNeoXForCausalLM",
    "neofix._families.gpt_neox",
    (
        Target("GPTNeoXModel", "forward", wrapper="make_model_forward", required=True),
        *_generate_targets("GPTNeoXForCausalLM"),
    ),
)

OPT = Family(
    "opt",
    "OPT",
    "transformers.models.opt.modeling_opt",
    "OPTDecoder",  # every step passes through the decoder (OPTModel.forward only hands the arguments on)
    "OPTForCausalLM",
    "neofix._families.opt",
    (
        Target("OPTDecoder", "forward", wrapper="make_model_forward", required=True),
        *_generate_targets("OPTForCausalLM", stopping=False),
        Target(
            "",
            "_prepare_4d_causal_attention_mask",
            wrapper="make_prepare_4d_mask_in_float64",
            since="4.36",
            until="4.49",
            why="only transformers 4.36 - 4.48 build OPT's causal mask through these helpers, which overflow in float64",
        ),
        Target(
            "",
            "_prepare_4d_causal_attention_mask_for_sdpa",
            wrapper="make_prepare_4d_mask_in_float64",
            since="4.36",
            until="4.49",
            why="only transformers 4.36 - 4.48 build OPT's causal mask through these helpers, which overflow in float64",
        ),
        Target(
            "OPTForCausalLM",
            "_get_stopping_criteria",
            wrapper="",
            why="OPT counts positions over real tokens only (left padding takes none): whether generate runs past the "
            "table depends on the mask's values, so neofix stops nothing early and names the overflow when it happens",
        ),
    ),
)

BLOOM = Family(
    "bloom",
    "BLOOM",
    "transformers.models.bloom.modeling_bloom",
    "BloomModel",
    "BloomForCausalLM",
    "neofix._families.bloom",
    (
        Target("BloomModel", "forward", wrapper="make_model_forward", required=True),
        Target(
            "BloomForCausalLM",
            "prepare_inputs_for_generation",
            wrapper="make_prepare_inputs_for_generation",
            required=True,
            since="4.36",
            why="before 4.36 the wrapper would read the cache's length as a (batch, heads, tokens, head_dim) cache's, "
            "but BLOOM's keys there are (batch * heads, head_dim, tokens): it would feed the wrong tokens",
        ),
        Target("BloomForCausalLM", "generate", wrapper="make_generate", required=True),
        Target(
            "BloomForCausalLM",
            "_get_stopping_criteria",
            wrapper="",
            why="BLOOM has no position table (ALiBi): no generate call runs past one, so there is nothing to refuse",
        ),
        Target(
            "",
            "_prepare_4d_causal_attention_mask",
            wrapper="make_prepare_4d_mask_for_float64",
            since="4.36",
            until="4.44",
            why="only transformers 4.36 - 4.43 build BLOOM's causal mask through this helper, which overflows in "
            "float64 (BLOOM turns the mask into booleans, so one built in float32 is the same mask)",
        ),
    ),
)

#: Every family neofix patches, by name.
FAMILIES: dict[str, Family] = {
    family.name: family for family in (GPT_NEO, GPT2, GPTJ, CODEGEN, GPT_NEOX, OPT, BLOOM)
}
