"""The model families neofix patches, declared: each one's modeling module and the attributes neofix replaces there.

Importing this package imports neither torch nor transformers (``import neofix`` reads it to register its import
hooks).  A family's adapter (the part that reads its forward's arguments, config and cache: a
:class:`~neofix._families._contract.Adapter`) lives in a module of this package imported only when the family's
modeling module is loaded.

Adding a family: declare its :class:`Family` below (usually with :func:`_standard`) and add it to
:data:`FAMILIES`; write ``neofix/_families/<name>.py`` declaring its ``ADAPTER``; add it to the doctor's and the
tests' tiny configs (``neofix.testing.FAMILY_CONFIGS``).  Nothing in ``neofix/_core`` changes.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time
if TYPE_CHECKING:
    from typing import Any


class Target:
    """One attribute neofix replaces (or, with ``wrapper=""``, deliberately leaves alone: the doctor says why).

    ``owner`` is a class of the family's modeling module ("" for the module itself); ``wrapper`` the name of the
    factory in :mod:`neofix._wrappers` (or, for a family's own, in its adapter module) that receives the original and
    returns its replacement.  ``since`` /
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

    def patched_here(self) -> bool:
        """Whether neofix patches the family on the installed transformers (its base model's forward is in range)."""
        from .. import _compat

        forward = self.targets[0]
        return _compat.in_range(forward.since, forward.until)

    def load_adapter(self) -> Any:
        """The family's :class:`~neofix._families._contract.Adapter` (imports torch and transformers)."""
        import importlib

        return importlib.import_module(self.adapter).ADAPTER


def _standard(
    name: str,
    title: str,
    base_model: str,
    causal_lm: str,
    *more: Target,
    no_stopping: str = "",
    prepare_since: str | None = None,
    prepare_why: str = "",
    since: str | None = None,
    why_since: str = "",
) -> Family:
    """A family patched the usual way: its base model's forward and ``generate``'s entry points on its causal LM
    (input preparation, from ``prepare_since`` if given, with ``prepare_why`` for releases before it; ``generate``;
    and the stopping criteria, which neofix makes stop at a position table, unless ``no_stopping`` says why not),
    plus ``more``.  Its modeling module is ``transformers.models.<name>.modeling_<name>``.  ``since``: the first
    transformers release that has the family (its standard targets are gated to it)."""
    arrived = why_since or (f"transformers has {title} from {since}" if since else "")
    stopping = Target(
        causal_lm,
        "_get_stopping_criteria",
        wrapper="" if no_stopping else "make_get_stopping_criteria",
        required=not no_stopping,
        since=since,
        why=no_stopping or arrived,
    )
    targets = (
        Target(base_model, "forward", wrapper="make_model_forward", required=True, since=since, why=arrived),
        Target(
            causal_lm,
            "prepare_inputs_for_generation",
            wrapper="make_prepare_inputs_for_generation",
            required=True,
            since=prepare_since or since,
            why=prepare_why or arrived,
        ),
        Target(causal_lm, "generate", wrapper="make_generate", required=True, since=since, why=arrived),
        stopping,
    )
    return Family(
        name,
        title,
        f"transformers.models.{name}.modeling_{name}",
        base_model,
        causal_lm,
        f"neofix._families.{name}",
        targets + more,
    )


def _float64_mask(
    helper: str, family: str, since: str, until: str, *, widen: bool = False, wrapper: str = ""
) -> Target:
    """The module-level causal-mask ``helper`` a family imported, which overflows for float64 models in
    ``[since, until)``; ``widen`` for families that add the mask to float64 scores (see
    :func:`neofix._wrappers.make_prepare_4d_mask_for_float64`); ``wrapper`` for one of the family's own."""
    wrapper = wrapper or ("make_prepare_4d_mask_in_float64" if widen else "make_prepare_4d_mask_for_float64")
    last = f"{until.split('.')[0]}.{int(until.split('.')[1]) - 1}"
    return Target(
        "",
        helper,
        wrapper=wrapper,
        since=since,
        until=until,
        why=f"only transformers {since} - {last} build {family}'s causal mask through this helper, which overflows "
        f"in float64",
    )


def _unmask_converter(path: str) -> Target:
    """``AttentionMaskConverter`` as a family's modeling module imported it on 4.36 - 4.38, whose sdpa ``path``
    unmasks the rows of a left-padded chunk after a cache wrongly (``gpt_bigcode.make_unmask_converter``)."""
    return Target(
        "",
        "AttentionMaskConverter",
        wrapper="make_unmask_converter",
        since="4.36",
        until="4.39",
        why=f"only transformers 4.36 - 4.38 unmask the rows of a left-padded chunk after a cache in {path} by "
        "counting its columns from 0 (4.39 unmasks the rows every key of which is masked)",
    )


GPT_NEO = _standard(
    "gpt_neo",
    "GPT-Neo",
    "GPTNeoModel",
    "GPTNeoForCausalLM",
    # a local layer over a static cache takes its window at the tokens' slots (neofix._families.gpt_neo); before
    # 4.45 GPT-Neo's attention layers get their own (key, value) pair, never a static cache
    Target(
        "GPTNeoSelfAttention",
        "forward",
        wrapper="make_static_window_forward",
        since="4.45",
        why="before 4.45 GPT-Neo's attention layers take no cache object, so no static cache reaches them",
    ),
    Target("GPTNeoFlashAttention2", "forward", wrapper="make_flash_attention_forward", since="4.36"),
    _float64_mask("_prepare_4d_causal_attention_mask", "GPT-Neo", "4.36", "4.45"),
)

# GPT-2's sdpa attention (the default) builds its mask through the _for_sdpa helper
GPT2 = _standard(
    "gpt2", "GPT-2", "GPT2Model", "GPT2LMHeadModel",
    _float64_mask("_prepare_4d_causal_attention_mask_for_sdpa", "GPT-2", "4.42", "4.52", widen=True),
)

GPTJ = _standard("gptj", "GPT-J", "GPTJModel", "GPTJForCausalLM")

CODEGEN = _standard("codegen", "CodeGen", "CodeGenModel", "CodeGenForCausalLM")

GPT_NEOX = _standard("gpt_neox", "GPT-NeoX", "GPTNeoXModel", "GPTNeoXForCausalLM")

OPT = _standard(
    "opt",
    "OPT",
    "OPTDecoder",  # every step passes through the decoder (OPTModel.forward only hands the arguments on)
    "OPTForCausalLM",
    _float64_mask("_prepare_4d_causal_attention_mask", "OPT", "4.36", "4.49", widen=True),
    _float64_mask("_prepare_4d_causal_attention_mask_for_sdpa", "OPT", "4.36", "4.49", widen=True),
    no_stopping="OPT counts positions over real tokens only (left padding takes none): whether generate runs past "
    "the table depends on the mask's values, so neofix stops nothing early and names the overflow when it happens",
)

BLOOM = _standard(
    "bloom",
    "BLOOM",
    "BloomModel",
    "BloomForCausalLM",
    # BLOOM turns the mask into booleans, so one built in float32 is the same mask
    _float64_mask("_prepare_4d_causal_attention_mask", "BLOOM", "4.36", "4.44"),
    no_stopping="BLOOM has no position table (ALiBi): no generate call runs past one, so there is nothing to refuse",
    prepare_since="4.36",
    prepare_why="before 4.36 the wrapper would read the cache's length as a (batch, heads, tokens, head_dim) cache's, "
    "but BLOOM's keys there are (batch * heads, head_dim, tokens): it would feed the wrong tokens",
)

# GPT-BigCode arrived in 4.28; the first release of the test matrix that has it is 4.30 (tox.ini)
GPT_BIGCODE = _standard(
    "gpt_bigcode",
    "GPT-BigCode",
    "GPTBigCodeModel",
    "GPTBigCodeForCausalLM",
    # its sdpa path unmasks the rows of left-padding queries as if a step of several tokens started the sequence
    _unmask_converter("GPT-BigCode's sdpa path"),
    since="4.30",
    why_since="neofix patches GPT-BigCode from transformers 4.30 (transformers has it from 4.28; 4.28 - 4.29 are not "
    "tested: no release of the test matrix has them)",
)


def _rotary(
    name: str,
    title: str,
    base_model: str,
    causal_lm: str,
    since: str,
    *more: Target,
    patched_from: str | None = None,
    untested: str = "",
) -> Family:
    """A decoder of Llama's kind (rotary positions, no position table) that arrived in transformers ``since``, plus
    ``more``; patched from its arrival, or from ``patched_from`` where neofix is not tested on the releases before it
    (``untested`` says which, and why: the lifecycle and ``neofix doctor`` report it)."""
    patched_from = patched_from or since
    return _standard(
        name,
        title,
        base_model,
        causal_lm,
        *more,
        no_stopping=f"{title}'s rotary positions extrapolate past max_position_embeddings: no generate call runs past "
        "a table, so there is nothing to refuse",
        since=patched_from,
        why_since=f"neofix patches {title} from transformers {patched_from} (transformers has it from {since}; "
        f"{untested})" if patched_from != since else "",
    )


def _rotary_float64_masks(family: str, since: str, until: str) -> tuple[Target, Target]:
    """The eager and the sdpa causal-mask helpers a rotary family imported in ``[since, until)``, which overflow for
    float64 models; the sdpa one also unmasks a left-padded chunk after a cache wrongly up to 4.38
    (:func:`neofix._wrappers.make_prepare_4d_sdpa_mask`)."""
    return (
        _float64_mask("_prepare_4d_causal_attention_mask", family, since, until),
        _float64_mask(
            "_prepare_4d_causal_attention_mask_for_sdpa", family, since, until, wrapper="make_prepare_4d_sdpa_mask"
        ),
    )


# Llama, Mistral, Gemma, Gemma2, Phi3, Starcoder2 and OLMo2 are patched from the first release of the test matrix
# (tox.ini) that has them; Phi, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Gemma3, Granite, SmolLM3, GPT-OSS, OLMo and
# Cohere from their arrival (Qwen2 4.37 - 4.39 build its mask as the tested 4.40 does: through the helpers below).
# Before 4.42 several of them build their causal mask through transformers' helpers, which overflow in float64 (vanilla
# cannot run a float64 model there; neofix can).
LLAMA = _rotary(
    "llama", "Llama", "LlamaModel", "LlamaForCausalLM", "4.28",
    *_rotary_float64_masks("Llama", "4.36", "4.38"),
    patched_from="4.30",
    untested="4.28 - 4.29 are not tested",
)
MISTRAL = _rotary(
    "mistral", "Mistral", "MistralModel", "MistralForCausalLM", "4.34",
    *_rotary_float64_masks("Mistral", "4.36", "4.42"),
    patched_from="4.36",
    untested="4.34 - 4.35 are not tested",
)
QWEN2 = _rotary(
    "qwen2", "Qwen2", "Qwen2Model", "Qwen2ForCausalLM", "4.37",
    *_rotary_float64_masks("Qwen2", "4.37", "4.42"),
)
QWEN2_MOE = _rotary(
    "qwen2_moe", "Qwen2-MoE", "Qwen2MoeModel", "Qwen2MoeForCausalLM", "4.40",
    *_rotary_float64_masks("Qwen2-MoE", "4.40", "4.42"),
)
QWEN3 = _rotary("qwen3", "Qwen3", "Qwen3Model", "Qwen3ForCausalLM", "4.51")
QWEN3_MOE = _rotary("qwen3_moe", "Qwen3-MoE", "Qwen3MoeModel", "Qwen3MoeForCausalLM", "4.51")
GEMMA2 = _rotary(
    "gemma2", "Gemma2", "Gemma2Model", "Gemma2ForCausalLM", "4.42",
    patched_from="4.45",
    untested="4.42 - 4.44 are not tested: no release of the test matrix has them",
)
GEMMA3 = _rotary("gemma3", "Gemma3", "Gemma3TextModel", "Gemma3ForCausalLM", "4.50")
GEMMA = _rotary(
    "gemma", "Gemma", "GemmaModel", "GemmaForCausalLM", "4.38",
    patched_from="4.40",
    untested="4.38 - 4.39 are not tested: no release of the test matrix has them",
)
PHI = _rotary("phi", "Phi", "PhiModel", "PhiForCausalLM", "4.36", *_rotary_float64_masks("Phi", "4.36", "4.42"))
MIXTRAL = _rotary(
    "mixtral", "Mixtral", "MixtralModel", "MixtralForCausalLM", "4.36",
    *_rotary_float64_masks("Mixtral", "4.36", "4.42"),
)
GRANITE = _rotary("granite", "Granite", "GraniteModel", "GraniteForCausalLM", "4.45")
SMOLLM3 = _rotary("smollm3", "SmolLM3", "SmolLM3Model", "SmolLM3ForCausalLM", "4.53")
GPT_OSS = _rotary("gpt_oss", "GPT-OSS", "GptOssModel", "GptOssForCausalLM", "4.55")
STARCODER2 = _rotary(
    "starcoder2", "Starcoder2", "Starcoder2Model", "Starcoder2ForCausalLM", "4.39",
    *_rotary_float64_masks("Starcoder2", "4.40", "4.42"),
    patched_from="4.40",
    untested="4.39 is not tested: no release of the test matrix has it",
)
OLMO2 = _rotary(
    "olmo2", "OLMo2", "Olmo2Model", "Olmo2ForCausalLM", "4.47",
    patched_from="4.48",
    untested="4.47 is not tested: no release of the test matrix has it",
)
# OLMo (the first) and Cohere (Command-R) arrived in 4.40 with Llama's causal mask of that release (built from
# cache_position, not through the float64 helpers)
OLMO = _rotary("olmo", "OLMo", "OlmoModel", "OlmoForCausalLM", "4.40")
COHERE = _rotary("cohere", "Cohere", "CohereModel", "CohereForCausalLM", "4.40")
# Falcon: rotary positions, or ALiBi where its config says (its adapter's positions_of); patched from the first release
# of the test matrix that has it.  4.36 - 4.44 build its causal mask through transformers' helpers (float64 overflows;
# the sdpa one unmasks a left-padded rotary chunk after a cache wrongly up to 4.38), and with ALiBi its sdpa path
# unmasks such a chunk through AttentionMaskConverter wrongly on 4.36 - 4.38 (as GPT-BigCode's there)
FALCON = _standard(
    "falcon",
    "Falcon",
    "FalconModel",
    "FalconForCausalLM",
    *_rotary_float64_masks("Falcon", "4.36", "4.45"),
    _unmask_converter("Falcon's ALiBi sdpa path"),
    no_stopping="Falcon has no position table (its rotary positions and ALiBi extrapolate past "
    "max_position_embeddings): no generate call runs past one, so there is nothing to refuse",
    since="4.36",
    why_since="neofix patches Falcon from transformers 4.36 (transformers has it from 4.33; 4.33 - 4.35 are not tested: "
    "no release of the test matrix has them)",
)
PHI3 = _rotary(
    "phi3", "Phi3", "Phi3Model", "Phi3ForCausalLM", "4.41",
    patched_from="4.45",
    untested="4.41 - 4.44 are not tested: no release of the test matrix has them",
)

#: Every family neofix patches, by name.
FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        GPT_NEO, GPT2, GPTJ, CODEGEN, GPT_NEOX, OPT, BLOOM, GPT_BIGCODE,
        LLAMA, MISTRAL, MIXTRAL, QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE, GEMMA, GEMMA2, GEMMA3, PHI, PHI3, GRANITE, SMOLLM3,
        GPT_OSS, STARCODER2, OLMO2, OLMO, COHERE, FALCON,
    )
}

_COUNTS = dict(enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                         "sixteen seventeen eighteen nineteen twenty".split()))
_COUNTS.update({20 + n: f"twenty-{word}" for n, word in list(_COUNTS.items())[1:10]})


def count_in_words() -> str:
    """How many families neofix patches, in words ("fourteen"): what the help texts and the docs say."""
    return _COUNTS.get(len(FAMILIES), str(len(FAMILIES)))


def titles() -> str:
    """The families' titles in registry order, as a sentence lists them: "GPT-Neo, GPT-2, ... and Phi3"."""
    names = [family.title for family in FAMILIES.values()]
    return ", ".join(names[:-1]) + " and " + names[-1]

