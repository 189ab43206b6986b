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

#: Every family neofix patches, by name.
FAMILIES: dict[str, Family] = {family.name: family for family in (GPT_NEO,)}
