"""The doctor's scenarios: decoding patterns GPT-Neo users write, right and wrong, and what each must give.

Each scenario is a plain function of a :class:`Context` that decodes and returns the generated tokens (or raises).
It runs unchanged twice, on vanilla transformers and with neofix; the verdicts come from comparing what it
returned with the full-recompute reference of :mod:`neofix.testing`, never from a table of expected strings.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from .._caches import keyword as cache_keyword
from .._caches import of_output
from .._errors import (
    BatchMismatchError,
    MaskLengthError,
    MaskValueError,
    NeofixError,
    PositionError,
    SequenceTooLongError,
    TokenIdError,
)
from ..testing import reference_greedy, reference_positions

#: Decode steps after the prompt; with the built-in model's window of 4 every sequence crosses a local window.
STEPS = 8
#: Real lengths of the rows of the left-padded batch most scenarios decode.
ROW_LENGTHS = (6, 3, 5)
BEAMS = 3


class Context:
    """The model under test and what the scenarios share: inputs, the pad id, and references computed once.

    ``adapter`` is the model family's (``neofix._families``): what positions mean to it (``POSITIONS``) and whether
    a sequence past its position table is an error decide what the scenarios expect.
    """

    def __init__(self, model: Any, adapter: Any = None) -> None:
        import inspect

        from .._families._contract import for_model

        if adapter is None:
            from .._families.gpt_neo import ADAPTER as adapter
        config = model.config
        self.model = model
        self.adapter = adapter = for_model(adapter, config)  # (Falcon's positions: its config's kind)
        self.vocab_size = int(config.vocab_size)
        self.positions_kind = adapter.positions.value
        #: the position table's size where running past it is an error, else None (the model extrapolates)
        self.limit = adapter.limits(config).max_positions
        self.max_positions = self.limit if self.limit is not None else _table_size(config)
        self.cache_keyword = cache_keyword(type(model).forward)
        self.takes_positions = "position_ids" in inspect.signature(type(model).forward).parameters
        self.eos = _first_id(getattr(model.generation_config, "eos_token_id", None))
        if self.eos is None:
            self.eos = _first_id(config.eos_token_id)
        pad = _first_id(getattr(model.generation_config, "pad_token_id", None))
        if pad is None:
            pad = _first_id(config.pad_token_id)
        # checkpoints without a pad token (gpt-neo-125M has none) pad with eos, as their users do
        self.pad = pad if pad is not None else (self.eos if self.eos is not None else 0)
        self.ids, self.mask = left_padded_batch(ROW_LENGTHS, self.vocab_size, self.pad)
        self._references: dict[str, torch.Tensor] = {}
        #: full recompute near the table's end: (its new tokens, whether EOS came in time), once computed
        self._near_the_end: tuple[torch.Tensor, bool] | None = None

    def reference(self) -> torch.Tensor:
        """The STEPS tokens full recompute gives for the left-padded batch (one forward over everything per step)."""
        if "greedy" not in self._references:
            full = reference_greedy(self.model, self.ids, self.mask, STEPS)
            self._references["greedy"] = full[:, self.ids.shape[1]:]
        return self._references["greedy"]

    def generate_reference(self, beams: int) -> torch.Tensor:
        """What ``generate`` must return: full recompute, finished rows padded after eos as generate does."""
        key = f"generate{beams}"
        if key not in self._references:
            if beams == 1:
                self._references[key] = _finish_like_generate(self.reference(), self.eos, self.pad)
            else:
                # beam search by full recompute: transformers' own beam search with the cache turned off
                self._references[key] = self._without_cache_position(lambda: self.generate(beams, use_cache=False))
        return self._references[key]

    def _without_cache_position(self, call: Any) -> Any:
        """``call()``; on transformers 4.39 - 4.40, with the ``cache_position`` generate passes taken out of every
        forward: without a cache those releases' generate passes one position (the last one plus one) for every token
        fed, from which the model builds a wrong causal mask (Llama: a wrong reference, vanilla and patched alike);
        left out, the model counts every token's position itself, as a full recompute must."""
        from .. import _compat

        if not (4, 39) <= _compat.release() < (4, 41):
            return call()

        def drop(_module: Any, args: Any, kwargs: dict) -> Any:
            kwargs.pop("cache_position", None)
            return args, kwargs

        handle = self.model.register_forward_pre_hook(drop, with_kwargs=True)
        try:
            return call()
        finally:
            handle.remove()

    @torch.no_grad()
    def generate(self, beams: int, **kwargs: Any) -> torch.Tensor:
        out = self.model.generate(
            self.ids,
            attention_mask=self.mask,
            max_new_tokens=STEPS,
            do_sample=False,
            num_beams=beams,
            pad_token_id=self.pad,
            **kwargs,
        )
        return out[:, self.ids.shape[1]:]


def _table_size(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        size = getattr(config, name, None)
        if isinstance(size, int):
            return size
    return 2048


def _first_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def left_padded_batch(lengths: tuple[int, ...], vocab_size: int, pad: int, seed: int = 0) -> tuple[Any, Any]:
    """Random prompts of the given real lengths, left-padded with ``pad`` (ids avoid ``pad``), and their mask."""
    width = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size - 1, (len(lengths), width), generator=generator)
    ids = torch.where(ids >= pad, ids + 1, ids) if 0 <= pad < vocab_size else ids  # never the pad id itself
    mask = torch.ones_like(ids)
    for row, length in enumerate(lengths):
        ids[row, : width - length] = pad
        mask[row, : width - length] = 0
    return ids, mask


def _finish_like_generate(tokens: torch.Tensor, eos: int | None, pad: int) -> torch.Tensor:
    """Greedy tokens as generate returns them: after a row's eos, pad; stop once every row has finished."""
    if eos is None:
        return tokens
    tokens = tokens.clone()
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool)
    for step in range(tokens.shape[1]):
        tokens[finished, step] = pad
        finished |= tokens[:, step] == eos
        if bool(finished.all()):
            return tokens[:, : step + 1]
    return tokens


@torch.no_grad()
def decode(
    ctx: Context,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    steps: int,
    *,
    mask_mode: str = "synced",
    positions: str = "none",
    chunks: tuple[int, ...] = (),
) -> torch.Tensor:
    """A hand-written greedy loop with a KV cache, as users write it; returns the ``steps`` generated tokens.

    mask_mode  "synced": the mask covers cached + new tokens; "stale": the prompt's mask at every step;
               "preallocated": after the prompt, a mask already as long as the whole generation at every step.
    positions  "none" | "correct" (new tokens only) | "stale" (the prompt's, at every step) | "arange" (arange over
               the padded width, then the sequence length: the classic batched-generation bug) | "frozen" (right on
               the prompt, then the prompt's last position again at every step: a loop that does not increment).
    chunks     split points: the prompt is fed in pieces with the cache (chunked prefill).
    """
    bounds = [0, *chunks, ids.shape[1]]
    feeds = [ids[:, a:b] for a, b in zip(bounds, bounds[1:])]
    full_mask = mask if mask is not None else torch.ones_like(ids)
    cache = None
    fed = 0
    generated: list[torch.Tensor] = []
    next_tokens = ids[:, -1:]
    for step in range(len(feeds) - 1 + steps):
        new = feeds[step] if step < len(feeds) else next_tokens
        if step >= len(feeds):
            full_mask = torch.cat([full_mask, full_mask.new_ones((full_mask.shape[0], 1))], dim=-1)
        fed += new.shape[1]
        step_mask = full_mask[:, :fed]
        kwargs: dict[str, Any] = {"input_ids": new, "use_cache": True}
        if mask is not None:
            if mask_mode == "stale":
                kwargs["attention_mask"] = mask
            elif mask_mode == "preallocated" and step >= len(feeds):
                kwargs["attention_mask"] = torch.cat([mask, mask.new_ones((mask.shape[0], steps))], dim=-1)
            else:
                kwargs["attention_mask"] = step_mask
        if not ctx.takes_positions:  # ALiBi: the model takes none
            pass
        elif positions == "correct":
            kwargs["position_ids"] = reference_positions(step_mask)[:, -new.shape[1]:]
        elif positions == "stale":
            kwargs["position_ids"] = reference_positions(full_mask[:, : ids.shape[1]])
        elif positions == "arange":
            kwargs["position_ids"] = torch.arange(fed - new.shape[1], fed).unsqueeze(0)
        elif positions == "frozen":
            prompt_positions = reference_positions(full_mask[:, : ids.shape[1]])
            kwargs["position_ids"] = prompt_positions if step < len(feeds) else prompt_positions[:, -1:]
        if cache is not None:
            kwargs[ctx.cache_keyword] = cache
        out = ctx.model(**kwargs)
        cache = of_output(out)
        if step >= len(feeds) - 1:
            next_tokens = out.logits[:, -1:].argmax(-1)
            generated.append(next_tokens)
    return torch.cat(generated, dim=-1)


# --- the scenarios ----------------------------------------------------------------------------------------------


def _stale_mask(ctx: Context) -> torch.Tensor:
    return decode(ctx, ctx.ids, ctx.mask, STEPS, mask_mode="stale", positions="correct")


def _padded_without_positions(ctx: Context) -> torch.Tensor:
    return decode(ctx, ctx.ids, ctx.mask, STEPS, positions="none")


def _stale_positions(ctx: Context) -> torch.Tensor:
    return decode(ctx, ctx.ids, ctx.mask, STEPS, positions="stale")


def _arange_positions(ctx: Context) -> torch.Tensor:
    return decode(ctx, ctx.ids, ctx.mask, STEPS, positions="arange")


def _frozen_positions(ctx: Context) -> torch.Tensor:
    return decode(ctx, ctx.ids, ctx.mask, STEPS, positions="frozen")


def _chunked_prefill(ctx: Context) -> torch.Tensor:
    return decode(ctx, ctx.ids, ctx.mask, STEPS, chunks=(ctx.ids.shape[1] // 2,))


def _mask_too_long(ctx: Context) -> torch.Tensor:
    return decode(ctx, ctx.ids, ctx.mask, STEPS, mask_mode="preallocated", positions="correct")


def _batch_mismatch(ctx: Context) -> torch.Tensor:
    return decode(ctx, ctx.ids, ctx.mask[:-1], STEPS)


def _position_overflow(ctx: Context) -> torch.Tensor:
    prompt = ctx.max_positions - 2  # the third generated token needs position max_position_embeddings
    ids = torch.randint(0, ctx.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    return decode(ctx, ids, torch.ones_like(ids), 4)


def _overflow_vanilla(ctx: Context) -> torch.Tensor:
    """Where the model extrapolates past its table: what vanilla transformers computes (neofix must not change it)."""
    from .. import _lifecycle

    with _lifecycle.unpatched():
        return _position_overflow(ctx)


def _out_of_vocabulary(ctx: Context) -> torch.Tensor:
    ids = ctx.ids.clone()
    ids[1, -1] = ctx.vocab_size  # a tokenizer with more tokens than the model's embedding
    return decode(ctx, ids, ctx.mask, STEPS)


def _generate_greedy(ctx: Context) -> torch.Tensor:
    return ctx.generate(1)


def _generate_beam(ctx: Context) -> torch.Tensor:
    return ctx.generate(BEAMS)


#: The prompt near the table's end is NEAR_THE_END positions short of it; generate is asked for NEAR_THE_END_NEW new
#: tokens, more than fit (NEAR_THE_END + 1).
NEAR_THE_END, NEAR_THE_END_NEW = 6, 10


def _near_the_end(ctx: Context) -> tuple[torch.Tensor, int]:
    """A prompt 6 positions short of the table's end, and as EOS the first token plain greedy full recompute gives
    (so generate ends after it, unless the checkpoint's generation settings hold it back)."""
    ids = torch.randint(
        0, ctx.vocab_size, (1, ctx.max_positions - NEAR_THE_END), generator=torch.Generator().manual_seed(2)
    )
    first = reference_greedy(ctx.model, ids, None, 1)[0, -1]
    return ids, int(first)


@torch.no_grad()
def _generate_near_the_end(ctx: Context, **kwargs: Any) -> torch.Tensor:
    """``generate`` as the scenario calls it (the checkpoint's own generation settings apply): the new tokens."""
    ids, eos = _near_the_end(ctx)
    out = ctx.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEAR_THE_END_NEW, eos_token_id=eos,
        pad_token_id=ctx.pad, do_sample=False, num_beams=1, **kwargs,
    )
    return out[:, ids.shape[1]:]


def _generate_eos_near_the_end(ctx: Context) -> torch.Tensor:
    """max_new_tokens past the table, but EOS ends it in time: vanilla completes, so neofix must."""
    return _generate_near_the_end(ctx)


class _TableEnd:
    """A stopping criterion: stop before the forward that would pass the position table (the next token's forward
    covers the whole sequence without a cache, so it fits while the sequence has at most ``size`` tokens)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] > self.size, dtype=torch.bool,
                          device=input_ids.device)


def _eos_near_the_end_outcome(ctx: Context) -> tuple[torch.Tensor, bool]:
    """What full recompute does on this model: ``(its new tokens, whether EOS came before the table's end)``.

    transformers' own generate with the cache turned off (the checkpoint's generation settings apply, as in the
    scenario: a ``min_new_tokens``, a repetition penalty, suppressed tokens), on vanilla transformers, stopped before
    the forward that would pass the table where passing it is an error.  Computed once per context.
    """
    if ctx._near_the_end is None:
        from transformers import StoppingCriteriaList

        from .. import _lifecycle

        bounded = ctx.limit is not None or hasattr(ctx.adapter, "explain_overflow")  # else the model extrapolates
        extra: dict[str, Any] = {"use_cache": False}
        if bounded:
            extra["stopping_criteria"] = StoppingCriteriaList([_TableEnd(ctx.max_positions)])
        with _lifecycle.unpatched():
            tokens = _generate_near_the_end(ctx, **extra)
        _, eos = _near_the_end(ctx)
        ended = bool((tokens == eos).any(dim=-1).all())
        ctx._near_the_end = (tokens, ended or not bounded)
    return ctx._near_the_end


def _eos_near_the_end_reference(ctx: Context) -> torch.Tensor:
    return _eos_near_the_end_outcome(ctx)[0]


def _eos_in_time(scenario: Scenario, ctx: Context) -> Any:
    """On a model whose full recompute does not reach EOS before the table's end (a checkpoint that does not emit
    it so soon, or whose generation settings hold it back), generate must run up to the step that would overflow
    and raise SequenceTooLongError there (the step contract): vanilla fails at that step with a raw error."""
    try:
        _, in_time = _eos_near_the_end_outcome(ctx)
    except Exception:  # noqa: BLE001 - the reference fails: the self-check says so ("no reference")
        return None
    if in_time:
        return None
    return scenario._replace(
        title="generate past the table, no EOS in time", reference=None, error=SequenceTooLongError,
        strict_error=SequenceTooLongError, parity=False,
    )


class Scenario(NamedTuple):
    key: str
    title: str
    run: Callable[[Context], torch.Tensor]
    #: expected tokens (valid input), or None when the input is invalid and there is nothing to compare with
    reference: Callable[[Context], torch.Tensor] | None
    #: what neofix must raise in repair mode (None: it must give the reference tokens)
    error: type[NeofixError] | None
    #: what neofix must raise in strict mode (None: it must give the reference tokens)
    strict_error: type[NeofixError] | None
    #: generate parity: neofix's tokens must also be identical to vanilla's
    parity: bool = False
    #: for the family of the context: None (the scenario applies as declared), a reason it does not apply, or a
    #: Scenario to run instead (what the family expects)
    adapt: Callable[[Any, Context], Any] | None = None

    def expected_error(self, strict: bool) -> type[NeofixError] | None:
        return self.strict_error if strict else self.error

    def for_family(self, ctx: Context) -> Any:
        """This scenario as the context's family expects it, or a string: why it does not apply."""
        release = _release_limits(self, ctx)
        if release is not None:
            return release
        return self if self.adapt is None else (self.adapt(self, ctx) or self)


#: the scenarios that decode by hand on the model's own cache
_HAND_LOOPS = frozenset({
    "stale_mask", "padded_no_positions", "stale_positions", "arange_positions", "frozen_positions", "chunked_prefill",
    "mask_too_long", "position_overflow",
})


def _release_limits(scenario: Scenario, ctx: Context) -> Any:
    """What a family cannot do on the installed release, vanilla neither: Gemma2 and Gemma3 up to 4.52 build a
    HybridCache as long as the prompt when given none (no hand loop runs; neofix: CacheLengthError), and Gemma2 up to
    4.47 decodes left-padded rows wrong in its HybridCache (neofix refuses the prefill: MaskValueError)."""
    from .. import _compat

    name = ctx.adapter.family.name
    if name not in ("gemma2", "gemma3") or _compat.release() >= (4, 53):
        return None
    if scenario.key in _HAND_LOOPS:
        return "the model's own HybridCache holds the prompt only on this transformers release: no hand loop runs"
    if name == "gemma2" and _compat.release() < (4, 48) and scenario.key in ("generate_greedy", "generate_beam"):
        return scenario._replace(reference=None, error=MaskValueError, strict_error=MaskValueError, parity=False)
    return None


def _positions_matter(scenario: Scenario, ctx: Context) -> Any:
    if ctx.positions_kind == "none":
        return "the model takes no position_ids (ALiBi)"
    if not ctx.takes_positions:
        return "the model takes no position_ids on this transformers release"
    if ctx.positions_kind == "rotary":
        if scenario.key == "stale_positions":  # which positions the cache was built with cannot be told
            return scenario._replace(reference=None, error=PositionError, strict_error=PositionError)
        if scenario.key == "frozen_positions":  # neither scheme's: repaired (strict: an error), as for the others
            return None
        return "rotary positions: only their differences matter"
    return None


def _table(scenario: Scenario, ctx: Context) -> Any:
    if ctx.limit is None and ctx.adapter.explain_overflow is None:  # extrapolates: runs as vanilla
        # (OPT has no limit up front either, but names the overflow at the failing lookup: the error is expected)
        return scenario._replace(reference=_overflow_vanilla, error=None, strict_error=None, parity=True)
    return None


SCENARIOS = (
    Scenario("stale_mask", "hand-written loop, stale mask", _stale_mask, Context.reference, None, MaskLengthError),
    Scenario(
        "padded_no_positions", "left-padded loop, no position_ids", _padded_without_positions, Context.reference,
        None, None,
    ),
    Scenario(
        "stale_positions", "stale position_ids", _stale_positions, Context.reference, None, PositionError,
        adapt=_positions_matter,
    ),
    Scenario(
        "arange_positions", "left-padded loop, arange position_ids", _arange_positions, Context.reference, None,
        PositionError, adapt=_positions_matter,
    ),
    Scenario(
        "frozen_positions", "loop not incrementing position_ids", _frozen_positions, Context.reference, None,
        PositionError, adapt=_positions_matter,
    ),
    Scenario("chunked_prefill", "chunked prefill, left-padded", _chunked_prefill, Context.reference, None, None),
    Scenario(
        "mask_too_long", "mask longer than cache + input", _mask_too_long, Context.reference, MaskLengthError,
        MaskLengthError,
    ),
    Scenario("batch_mismatch", "mask batch != input batch", _batch_mismatch, None, BatchMismatchError,
             BatchMismatchError),
    Scenario(
        "position_overflow", "past max_position_embeddings", _position_overflow, None, SequenceTooLongError,
        SequenceTooLongError, adapt=_table,
    ),
    Scenario("out_of_vocabulary", "token id >= vocab_size", _out_of_vocabulary, None, TokenIdError, TokenIdError),
    Scenario(
        "generate_greedy", "generate, greedy, left-padded", _generate_greedy,
        lambda ctx: ctx.generate_reference(1), None, None, parity=True,
    ),
    Scenario(
        "generate_beam", f"generate, {BEAMS} beams, left-padded", _generate_beam,
        lambda ctx: ctx.generate_reference(BEAMS), None, None, parity=True,
    ),
    Scenario(
        "generate_eos_near_the_end", "generate past the table, EOS in time", _generate_eos_near_the_end,
        _eos_near_the_end_reference, None, None, parity=True, adapt=_eos_in_time,
    ),
)
