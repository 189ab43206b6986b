"""Every invalid step raises a ``NeofixError`` that names the offending value, what was expected and the fix.

Each case of ``CASES`` (the shared tiny model: vocab_size 96, max_position_embeddings 64, hidden_size 32, 4 layers,
caches of 2 rows x 5 tokens) is run twice:

* patched: the error class and every part of the message (value, expectation, fix) are asserted, and the model's
  weights, config and the cache passed in are exactly as before (a failed step changes nothing);
* unpatched: vanilla transformers' outcome must be exactly the one tests/_vanilla.py records for the case on the
  installed release (an exception class and message fragment, "silently wrong tokens" or "silently accepted"),
  which proves neofix is what changes it.  Vanilla runs in float32: transformers 4.36 - 4.44 cannot run GPT-Neo in
  float64 at all.

Errors found by a check are raised before any embedding lookup (on an accelerator a bad index is a device-side
assert, not an ``IndexError`` neofix could translate); only the cases marked ``translated`` (single-token decode
steps, whose values are not read by default) reach the embedding first, and those marked ``translated_on_cpu``
(token ids of a prefill or chunk, and given positions there, left to the embedding on the CPU) reach it first on the
CPU only: they are run again on the path accelerators take, which must raise before any lookup.

The value checks (``neofix.configure(check_values=...)``) are tested at the end, including that by default a
single-token decode step adds no tensor -> Python conversion (no host-device synchronisation on an accelerator).
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, NamedTuple

import pytest
import torch

inf = float("inf")

import neofix
from neofix import _caches
from neofix._core import _values
from neofix._families import gpt_neo
from neofix.testing import reference_greedy, reference_positions, tiny_gpt_neo

from ._sync import HostReads, device_reads, read_values_on
from ._vanilla import MEASURED, VANILLA, assert_vanilla, expected, nearest_measured, table_problems
from ._versions import cache_keyword, has, legacy, output_cache, requires
from .loops import left_padded_batch

@pytest.fixture(scope="module")
def model32():
    """The same tiny GPT-Neo in float32, for vanilla runs (4.36 - 4.44 cannot run float64 GPT-Neo unpatched)."""
    return tiny_gpt_neo(seed=0, dtype=torch.float32)


# -- helpers -----------------------------------------------------------------------------------------------------


def ones(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.long)


def padded(rows: int, columns: int) -> torch.Tensor:
    """A mask whose first column is a pad: read from its left or its right end, it says different things."""
    mask = ones(rows, columns)
    mask[:, 0] = 0
    return mask


def as_object(cache: Any, model: Any) -> Any:
    """The cache as a ``DynamicCache`` built for ``model`` (whatever the release returned)."""
    return _caches.from_legacy(legacy(cache), model.config)


@torch.no_grad()
def cached(model: Any, batch: int = 2, length: int = 5, fmt: str = "native") -> Any:
    """The cache of a prompt, as the model returned it (native), as legacy tuples or as a Cache object."""
    ids, mask = left_padded_batch([length] * batch, width=length)
    cache = output_cache(model(input_ids=ids, attention_mask=mask, use_cache=True))
    if fmt == "legacy":
        return legacy(cache)
    if fmt == "object":
        return as_object(cache, model)
    return cache


def forward(model: Any, cache: Any = None, **kwargs: Any) -> Callable[[], Any]:
    if cache is not None:
        kwargs[cache_keyword()] = cache
        kwargs.setdefault("use_cache", True)
    return lambda: model(**kwargs)


def cache_contents(cache: Any) -> Any:
    """A deep copy of what a cache holds: every layer's key and value, and (Cache objects) each layer's length."""
    if cache is None:
        return None
    layers = legacy(cache)
    tensors = [None if k is None else (k.clone(), v.clone()) for k, v in layers]
    lengths = None
    if not isinstance(cache, tuple) and hasattr(cache, "get_seq_length"):
        lengths = [cache.get_seq_length(i) for i in range(len(layers))]
    return type(cache), tensors, lengths


def assert_same_cache(before: Any, cache: Any) -> None:
    after = cache_contents(cache)
    if before is None:
        assert after is None
        return
    assert before[0] is after[0]
    assert before[2] == after[2], f"cache layer lengths changed: {before[2]} -> {after[2]}"
    assert len(before[1]) == len(after[1])
    for layer, (old, new) in enumerate(zip(before[1], after[1])):
        assert (old is None) == (new is None), f"cache layer {layer} changed"
        if old is not None:
            assert torch.equal(old[0], new[0]) and torch.equal(old[1], new[1]), f"cache layer {layer} changed"


def model_contents(model: Any) -> Any:
    return (
        {name: tensor.clone() for name, tensor in model.state_dict().items()},
        model.config.to_dict(),
        model.generation_config.to_dict(),
        model.training,
    )


def assert_same_model(before: Any, model: Any) -> None:
    weights, config, generation, training = before
    now = model.state_dict()
    assert now.keys() == weights.keys()
    assert all(torch.equal(now[name], weights[name]) for name in weights), "the model's weights changed"
    assert model.config.to_dict() == config
    assert model.generation_config.to_dict() == generation
    assert model.training == training


class Forwards:
    """Counts ``GPTNeoModel`` forwards (a pre-hook runs before neofix's wrapper, so every call counts)."""

    def __init__(self, model: Any) -> None:
        self.count = 0
        self.model = model

    def __enter__(self) -> "Forwards":
        self.handle = self.model.transformer.register_forward_pre_hook(self._hook)
        return self

    def _hook(self, *_: Any) -> None:
        self.count += 1

    def __exit__(self, *_: Any) -> None:
        self.handle.remove()


class Lookups:
    """Counts lookups in the token and position embeddings: the first thing a forward computes."""

    def __init__(self, model: Any) -> None:
        self.count = 0
        self.modules = [model.get_input_embeddings(), model.transformer.wpe]

    def __enter__(self) -> "Lookups":
        self.handles = [module.register_forward_pre_hook(self._hook) for module in self.modules]
        return self

    def _hook(self, *_: Any) -> None:
        self.count += 1

    def __exit__(self, *_: Any) -> None:
        for handle in self.handles:
            handle.remove()


# -- the cases ---------------------------------------------------------------------------------------------------


class Case(NamedTuple):
    """``build(model) -> (call, cache the call is given)``; the call must raise ``error`` with every pattern.

    What vanilla transformers does with the same call is in tests/_vanilla.py, under the case's name.
    """

    build: Callable[[Any], tuple[Callable[[], Any], Any]]
    error: type
    patterns: tuple[str, ...]  # regexes, each must match the message: the value, what was expected, the fix
    mode: str = "repair"
    check_values: bool = False
    translated: bool = False  # found by translating the embedding's IndexError (the lookup runs first)
    # translated on the CPU, read before the lookup on the accelerator path (a callable: of the model, measured)
    translated_on_cpu: bool | Callable[[Any], bool] = False
    well_formed: Callable[[Any], tuple[Callable[[], Any], Any]] | None = None  # the call as it should have been


def case(build, error, patterns, **settings) -> Case:
    return Case(build, error, tuple(patterns), **settings)


@torch.no_grad()
def generate_prefills_plainly(model: Any) -> bool:
    """Whether the installed release's ``generate`` calls the model's first forward as a plain prefill: the mask's
    positions and no cache object or ``cache_position`` (4.26 does; 4.45 and 5.x pass an empty cache), a forward
    whose token ids the CPU path leaves to the embedding."""
    calls = []
    hook = model.transformer.register_forward_pre_hook(lambda _, args, kwargs: calls.append(kwargs), with_kwargs=True)
    try:
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=1, pad_token_id=0)
    finally:
        hook.remove()
    first = calls[0]
    cache = first.get("cache", first.get("past_key_values"))
    return cache is None and first.get("cache_position") is None and first.get("position_ids") is not None


def _resolve(kwargs: dict, model: Any) -> dict:
    """Arguments may be callables of the model (a 4D mask in the model's dtype)."""
    return {name: value(model) if callable(value) else value for name, value in kwargs.items()}


def prefill(**kwargs: Any) -> Callable:
    """A builder: one forward without a cache."""
    return lambda m: (forward(m, **_resolve(kwargs, m)), None)


def step(cache_of: Callable = None, **kwargs: Any) -> Callable:
    """A builder: a cache (default: 2 rows x 5 tokens, as the model returns it), then one forward with it."""

    def build(m):
        cache = (cache_of or cached)(m)
        return forward(m, cache, **_resolve(kwargs, m)), cache

    return build


def object_cache(m: Any) -> Any:
    return cached(m, fmt="object" if has("Cache objects") else "legacy")


def float_mask(*shape: int) -> Callable:
    """An additive float mask (0: attend) in the model's dtype."""
    return lambda m: torch.zeros(*shape, dtype=m.dtype)


TOKEN_ID = (r"vocab_size is 96", r"must lie in \[0, 95\]")
TOKENIZER = r"tokenizer belongs to this model"
FIX_MASK = r"append a column of ones per new token"

CASES = {
    # token ids out of the vocabulary: prefill, chunked prefill, decode steps (checked or translated), generate
    "id >= vocab, prefill": case(
        prefill(input_ids=torch.tensor([[1, 2, 96]]), attention_mask=ones(1, 3)),
        neofix.TokenIdError,
        [r"input_ids\[0, 2\] is 96", *TOKEN_ID, TOKENIZER],
        translated_on_cpu=True,
    ),
    "id < 0, prefill without mask": case(
        prefill(input_ids=torch.tensor([[1, -1, 3]])),
        neofix.TokenIdError,
        [r"input_ids\[0, 1\] is -1", *TOKEN_ID, TOKENIZER],
        translated_on_cpu=True,
    ),
    "id >= vocab, chunked prefill": case(
        step(input_ids=torch.tensor([[1, 2, 3], [4, 500, 6]]), attention_mask=ones(2, 8)),
        neofix.TokenIdError,
        [r"input_ids\[1, 1\] is 500", *TOKEN_ID, TOKENIZER],
        translated_on_cpu=True,
    ),
    "id >= vocab, decode step (translated IndexError)": case(
        step(input_ids=torch.tensor([[1], [96]]), attention_mask=ones(2, 6)),
        neofix.TokenIdError,
        [r"input_ids\[1, 0\] is 96", *TOKEN_ID, TOKENIZER],
        translated=True,
    ),
    "id < 0, decode step, Cache object": case(
        step(object_cache, input_ids=torch.tensor([[-7], [3]]), attention_mask=ones(2, 6)),
        neofix.TokenIdError,
        [r"input_ids\[0, 0\] is -7", *TOKEN_ID, TOKENIZER],
        translated=True,
    ),
    "id = vocab, decode step, check_values=True": case(
        step(object_cache, input_ids=torch.tensor([[1], [96]]), attention_mask=ones(2, 6)),
        neofix.TokenIdError,
        [r"input_ids\[1, 0\] is 96", *TOKEN_ID, TOKENIZER],
        check_values=True,
        translated_on_cpu=True,  # the CPU reads no ids: the lookup raises first, and neofix names the id
    ),
    "token_type_ids >= vocab": case(
        prefill(input_ids=ones(1, 3), token_type_ids=torch.tensor([[0, 0, 96]])),
        neofix.TokenIdError,
        [r"token_type_ids\[0, 2\] is 96", *TOKEN_ID, r"embeds token types with the token embedding"],
        translated_on_cpu=True,  # the CPU reads no ids: the lookup raises first, and neofix names the id
    ),
    "id >= vocab, generate": case(
        lambda m: (lambda: m.generate(torch.tensor([[5, 96, 7]]), max_new_tokens=3, pad_token_id=0), None),
        neofix.TokenIdError,
        [r"input_ids\[0, 1\] is 96", *TOKEN_ID, TOKENIZER],
        translated_on_cpu=True,  # the CPU reads no ids: the lookup raises first, and neofix names the id
    ),
    # position ids outside the position table
    "position >= max_position_embeddings, prefill": case(
        prefill(input_ids=ones(1, 3), position_ids=torch.tensor([[0, 1, 64]])),
        neofix.PositionError,
        [r"position_ids\[0, 2\] is 64", r"max_position_embeddings is 64", r"\[0, 63\]", r"pass none"],
        translated_on_cpu=True,
    ),
    "position < 0 of a masked token, decode step (translated IndexError)": case(
        # a real token's position is compared with the mask's (and repaired); a masked token keeps what it is given
        step(
            input_ids=ones(2, 1),
            attention_mask=torch.tensor([[1] * 6, [1] * 5 + [0]]),
            position_ids=torch.tensor([[5], [-1]]),
        ),
        neofix.PositionError,
        [r"position_ids\[1, 0\] is -1", r"max_position_embeddings is 64", r"\[0, 63\]", r"pass none"],
        translated=True,
    ),
    "float position_ids": case(
        prefill(input_ids=ones(2, 5), attention_mask=ones(2, 5), position_ids=torch.arange(5.0).repeat(2, 1)),
        neofix.PositionError,
        [r"position_ids has dtype torch.float32", r"positions are integers \(each token.s index in its sequence\)", r"pass torch.long positions"],
    ),
    "float input_ids": case(
        prefill(input_ids=ones(2, 5).float(), attention_mask=ones(2, 5)),
        neofix.TokenIdError,
        [r"input_ids has dtype torch.float32", r"token ids are integers", r"tokenizer's input_ids"],
    ),
    # batch mismatches
    "mask batch 3 != input batch 2, prefill": case(
        prefill(input_ids=ones(2, 5), attention_mask=ones(3, 5)),
        neofix.BatchMismatchError,
        [r"attention_mask has 3 rows", r"this step feeds 2", r"pass one mask row per input row"],
    ),
    "mask batch 1 != input batch 2, decode step": case(
        step(input_ids=ones(2, 1), attention_mask=ones(1, 6)),
        neofix.BatchMismatchError,
        [r"attention_mask has 1 row,", r"this step feeds 2", r"pass one mask row per input row"],
    ),
    "4D mask batch 3 != input batch 2": case(
        step(input_ids=ones(2, 1), attention_mask=float_mask(3, 1, 1, 6)),
        neofix.BatchMismatchError,
        [r"4D attention_mask has 3 rows", r"this step feeds 2", r"one mask row per input row"],
    ),
    "position_ids batch 3 != input batch 2": case(
        prefill(input_ids=ones(2, 5), attention_mask=ones(2, 5), position_ids=torch.arange(5).repeat(3, 1)),
        neofix.BatchMismatchError,
        [r"position_ids has 3 rows", r"this step feeds 2", r"pass one row per input row"],
    ),
    "cache batch 3 != input batch 2": case(
        step(lambda m: cached(m, batch=3), input_ids=ones(2, 1), attention_mask=ones(2, 6)),
        neofix.BatchMismatchError,
        [r"the cache holds 3 rows", r"this step feeds 2", r"select the cache with the inputs"],
    ),
    # masks longer than cache + input (ambiguous), wrong 3D / 4D masks
    "mask longer than cache + input, decode step": case(
        step(input_ids=ones(2, 1), attention_mask=padded(2, 9)),
        neofix.MaskLengthError,
        [
            r"attention_mask has 9 columns",
            r"the cache holds 5 tokens and this step feeds 1: expected 6",
            r"pass the mask of exactly the cached plus the new tokens",
        ],
    ),
    "mask longer than input, prefill": case(
        prefill(input_ids=ones(2, 5), attention_mask=padded(2, 7)),
        neofix.MaskLengthError,
        [r"attention_mask has 7 columns", r"holds 0 tokens and this step feeds 5: expected 5", r"pass the mask of"],
    ),
    "prompt mask kept during chunked prefill": case(
        step(lambda m: cached(m, length=4), input_ids=ones(2, 2), attention_mask=padded(2, 9)),
        neofix.MaskLengthError,
        [r"attention_mask has 9 columns", r"holds 4 tokens and this step feeds 2: expected 6", r"pass the mask of"],
    ),
    "4D mask with the wrong key length": case(
        step(input_ids=ones(2, 1), attention_mask=float_mask(2, 1, 1, 7)),
        neofix.MaskLengthError,
        [
            r"4D attention_mask has shape \(2, 1, 1, 7\)",
            r"this step needs 1 row of queries \(one per new token\) and 6 columns, one per cached and new token",
            r"pass the 2D \(batch, cached \+ new tokens\) padding mask",
        ],
    ),
    "3D mask with the wrong key length": case(
        step(input_ids=ones(2, 1), attention_mask=ones(2, 1, 4)),
        neofix.MaskLengthError,
        [r"3D attention_mask has shape \(2, 1, 4\)", r"needs 1 row of queries \(one per new token\) and 6 columns, one", r"pass the 2D"],
    ),
    "4D mask with the wrong query length": case(
        prefill(input_ids=ones(2, 5), attention_mask=float_mask(2, 1, 4, 5)),
        neofix.MaskLengthError,
        [r"4D attention_mask has shape \(2, 1, 4, 5\)", r"this step needs 5 rows of queries \(one per new token\) and 5 columns"],
    ),
    # masks that do not say which tokens are real
    "mask values other than 0 and 1": case(
        prefill(input_ids=ones(2, 5), attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 0, 2, 1, 1]])),
        neofix.MaskValueError,
        [r"attention_mask\[1, 2\] is 2", r"holds 1 for a real token and 0 for padding", r"tokenizer's attention_mask"],
        well_formed=prefill(input_ids=ones(2, 5), attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])),
    ),
    "additive mask (0 and -inf) passed as the padding mask": case(
        prefill(input_ids=ones(2, 5), attention_mask=lambda m: torch.tensor([[0.0] * 5, [-inf, -inf, 0.0, 0.0, 0.0]],
                                                                            dtype=m.dtype)),
        neofix.MaskValueError,
        [r"attention_mask\[1, 0\] is -inf", r"additive mask", r"\(additive_mask == 0\)"],
    ),
    "the chunk's own mask after a cache": case(
        step(lambda m: cached(m, length=4), input_ids=ones(2, 2), attention_mask=padded(2, 2)),
        neofix.MaskLengthError,
        [
            r"attention_mask has 2 columns, but the cache holds 4 tokens and this step feeds 2: expected 6",
            r"as wide as this step's 2 new tokens, it may be their mask alone",
            r"torch.cat\(\[mask_so_far, new_mask\], -1\)",
        ],
    ),
    "mask covering some of the new tokens": case(
        step(lambda m: cached(m, length=4), input_ids=ones(2, 3), attention_mask=padded(2, 5)),
        neofix.MaskLengthError,
        [r"expected 7", r"covers the 4 cached tokens and only some of the 3 new tokens", r"exactly the cached plus"],
    ),
    # a cache another model built
    "cache of a model with other heads": case(
        step(lambda m: cached(tiny_gpt_neo(dtype=m.dtype, num_heads=2)), input_ids=ones(2, 1), attention_mask=ones(2, 6)),
        neofix.InputShapeError,
        [r"keys of 2 heads of width 16", r"this model has 4 heads of width 8", r"built by another model"],
    ),
    # cache layers of different lengths: named, and raised before any layer appends to the cache
    "cache layer 2 shorter, legacy tuples": case(
        step(lambda m: cropped(m, 2, "legacy"), input_ids=ones(2, 1), attention_mask=ones(2, 6)),
        neofix.CacheLengthError,
        [r"cache layer 2 holds 4 tokens", r"layer 0 holds 5", r"Crop every layer to the same length"],
    ),
    "cache layer 3 shorter, Cache object": case(
        step(lambda m: cropped(m, 3, "object"), input_ids=ones(2, 1), attention_mask=ones(2, 6)),
        neofix.CacheLengthError,
        [r"cache layer 3 holds 4 tokens", r"layer 0 holds 5", r"rebuild the cache"],
    ),
    "cache layer 0 shorter": case(
        step(lambda m: cropped(m, 0, "native"), input_ids=ones(2, 1), attention_mask=ones(2, 5)),
        neofix.CacheLengthError,
        [r"cache layer 1 holds 5 tokens", r"layer 0 holds 4", r"Crop every layer"],
    ),
    "cache with fewer layers than the model": case(
        step(lambda m: legacy(cached(m))[:3], input_ids=ones(2, 1), attention_mask=ones(2, 6)),
        neofix.CacheLengthError,
        [r"cache layer 3 holds 0 tokens", r"layer 0 holds 5", r"rebuild the cache"],
    ),
    # empty steps, wrong embedding widths
    "empty step with a cache": case(
        step(input_ids=ones(2, 0), attention_mask=ones(2, 5)),
        neofix.InputShapeError,
        [r"feeds no new tokens \(input_ids has 0 columns, batch 2\)", r"needs at least one token", r"stop the loop"],
    ),
    "empty prefill": case(
        prefill(input_ids=ones(1, 0)),
        neofix.InputShapeError,
        [r"feeds no new tokens", r"at least one token", r"stop the loop"],
    ),
    "inputs_embeds of the wrong width": case(
        prefill(inputs_embeds=lambda m: torch.zeros(2, 5, 31, dtype=m.dtype), attention_mask=ones(2, 5)),
        neofix.InputShapeError,
        [r"inputs_embeds has shape \(2, 5, 31\)", r"expects \(batch, new_tokens, 32\)", r"get_input_embeddings\(\)"],
    ),
    # sequences past max_position_embeddings
    "prefill longer than max_position_embeddings": case(
        prefill(input_ids=ones(1, 65)),
        neofix.SequenceTooLongError,
        [r"would reach sequence length 65", r"is 64: 64 more new tokens fit", r"shorten the prompt"],
    ),
    "decode step past max_position_embeddings": case(
        step(lambda m: cached(m, 1, 64), input_ids=ones(1, 1), attention_mask=ones(1, 65)),
        neofix.SequenceTooLongError,
        [r"length 65 \(the cache holds 64 tokens and the step feeds 1\)", r"is 64: 0 more", r"generate fewer tokens"],
    ),
    "chunk crossing max_position_embeddings": case(
        step(lambda m: cached(m, 1, 61), input_ids=ones(1, 5), attention_mask=ones(1, 66)),
        neofix.SequenceTooLongError,
        [r"sequence length 66", r"is 64: 3 more new tokens fit", r"shorten the prompt"],
    ),
    # strict mode: every repair becomes an error
    "strict: mask not extended": case(
        step(input_ids=ones(2, 1), attention_mask=ones(2, 5)),
        neofix.MaskLengthError,
        [r"attention_mask has 5 columns", r"expected 6", FIX_MASK],
        mode="strict",
        well_formed=step(input_ids=ones(2, 1), attention_mask=ones(2, 6)),
    ),
    "strict: full-length position_ids": case(
        step(input_ids=ones(2, 1), attention_mask=ones(2, 6), position_ids=torch.arange(6).repeat(2, 1)),
        neofix.PositionError,
        [r"position_ids has 6 columns", r"this step feeds 1 new token ", r"pass only the new tokens' positions"],
        mode="strict",  # in repair mode neofix takes the last column (tested in test_loops)
    ),
    "strict: stale prompt position_ids": case(
        step(input_ids=ones(2, 1), attention_mask=ones(2, 6), position_ids=torch.arange(5).repeat(2, 1)),
        neofix.PositionError,
        [r"position_ids has 5 columns", r"the cache holds 5", r"pass only the new tokens' positions"],
        mode="strict",
    ),
    "strict: a decode step's position disagrees with the mask": case(
        step(input_ids=ones(2, 1), attention_mask=ones(2, 6), position_ids=torch.tensor([[5], [4]])),
        neofix.PositionError,
        [
            r"position_ids\[1, 0\] is 4 at the step after 5 cached tokens",
            r"the attention mask puts that real token of row 1 at position 5",
            r"advance by one per real token",
        ],
        mode="strict",  # repaired on the device in repair mode (tests/test_position_values.py)
        well_formed=step(input_ids=ones(2, 1), attention_mask=ones(2, 6), position_ids=torch.tensor([[5], [5]])),
    ),
    "strict: arange positions over a left-padded prefill": case(
        prefill(
            input_ids=ones(2, 5),
            attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]),
            position_ids=torch.arange(5)[None],
        ),
        neofix.PositionError,
        [r"position_ids count the left padding of row 1", r"is at position 2, but the attention mask puts it at 0"],
        mode="strict",
        well_formed=prefill(
            input_ids=ones(2, 5),
            attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]),
            position_ids=torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]),
        ),
    ),
    "strict: decoding from a right-padded prompt": case(
        lambda m: (forward(m, right_padded_cache(m), input_ids=ones(2, 1), attention_mask=right_padded_mask(6)), None),
        neofix.MaskValueError,
        [r"right padding in row 1", r"predicted from a pad", r"pad prompts on the left"],
        mode="strict",
    ),
    "generate with a prompt of 0 tokens": case(
        lambda m: (lambda: m.generate(ones(1, 0), max_new_tokens=3, pad_token_id=0), None),
        neofix.InputShapeError,
        [r"prompt of 0 tokens", r"needs at least one token", r"bos_token_id"],
    ),
}


def right_padded_mask(width: int) -> torch.Tensor:
    mask = ones(2, width)
    mask[1, 3:5] = 0  # row 1: 3 real tokens, then the prompt's right padding (2 columns), then the new tokens
    return mask


@torch.no_grad()
def right_padded_cache(model: Any) -> Any:
    """The cache of a right-padded prompt, as the model returned it (patched: neofix marks it)."""
    return output_cache(model(input_ids=ones(2, 5), attention_mask=right_padded_mask(5), use_cache=True))


@torch.no_grad()
def cropped(model: Any, layer: int, fmt: str) -> Any:
    """A cache of 5 tokens whose ``layer`` holds only 4 (layer 0 cropped: the others hold one more)."""
    native = cached(model)
    layers = legacy(native)
    bad = tuple((k[..., 1:, :], v[..., 1:, :]) if i == layer else (k, v) for i, (k, v) in enumerate(layers))
    if (fmt == "object" and has("Cache objects")) or (fmt == "native" and not isinstance(native, tuple)):
        return as_object(bad, model)
    return bad


@pytest.mark.parametrize("name", list(CASES))
def test_invalid_step_raises_a_clear_error(model, model32, name):
    spec = CASES[name]
    neofix.configure(mode=spec.mode, check_values=spec.check_values)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own deprecation warnings (tuple caches on 4.45 - 4.53)
        call, cache = spec.build(model)
    before_model, before_cache = model_contents(model), cache_contents(cache)
    with Lookups(model) as lookups, pytest.raises(spec.error) as raised, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call()
    message = str(raised.value)
    for pattern in spec.patterns:
        assert re.search(pattern, message), f"{pattern!r} not in: {message}"
    assert isinstance(raised.value, ValueError)
    on_cpu = spec.translated_on_cpu(model) if callable(spec.translated_on_cpu) else spec.translated_on_cpu
    if not (spec.translated or on_cpu):
        assert lookups.count == 0, f"an embedding lookup ran before the {spec.error.__name__}: the check came too late"
    if spec.translated or on_cpu:  # the embedding's IndexError is kept as the cause
        assert isinstance(raised.value.__cause__, IndexError)
        assert "index out of range" in str(raised.value.__cause__)
    if on_cpu:
        # the path accelerators take: the ids are read before any lookup
        with device_reads(), Lookups(model) as lookups, pytest.raises(spec.error) as again, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call()
        assert str(again.value) == message and lookups.count == 0
    assert_same_model(before_model, model)
    assert_same_cache(before_cache, cache)

    with neofix.unpatched():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            vanilla_call, _ = spec.build(model32)
            right = spec.well_formed(model32)[0] if spec.well_formed else None
        assert_vanilla(name, vanilla_call, wrong=right and (lambda out: other_tokens(out, right())))


def other_tokens(out: Any, well_formed: Any) -> bool:
    """Whether a forward's output predicts other tokens than the well-formed call's."""
    return not torch.equal(out.logits.argmax(-1), well_formed.logits.argmax(-1))


def test_vanilla_table_covers_every_case_and_measured_release():
    assert set(CASES) <= set(VANILLA), sorted(set(CASES) - set(VANILLA))
    assert table_problems() == []


@pytest.mark.parametrize(
    "release, nearest",
    [
        ((4, 26), (4, 26)),
        ((4, 20), (4, 26)),
        ((4, 33), (4, 30)),  # a tie goes to the older release
        ((4, 34), (4, 36)),
        ((4, 38), (4, 36)),  # a tie again
        ((4, 56), (4, 55)),  # and again
        ((5, 5), (5, 0)),
        ((5, 6), (5, 10)),
        ((5, 40), (5, 25)),
        ((6, 0), (5, 25)),
    ],
)
def test_an_unmeasured_release_uses_the_nearest_measured_one(release, nearest):
    assert nearest in MEASURED
    assert nearest_measured(release) == nearest
    name = "mask batch 1 != input batch 2, decode step"
    assert expected(name, release) == expected(name, nearest)


def test_cases_cover_every_error_class():
    """The table covers each error class neofix defines (AttentionWindowError: tests/test_flash_window.py and the
    static-cache tests of tests/test_generate_limits.py, which need a GPU or a release with static caches)."""
    classes = {spec.error for spec in CASES.values()}
    assert classes == {
        neofix.TokenIdError,
        neofix.PositionError,
        neofix.BatchMismatchError,
        neofix.MaskLengthError,
        neofix.MaskValueError,
        neofix.CacheLengthError,
        neofix.InputShapeError,
        neofix.SequenceTooLongError,
    }


@pytest.mark.parametrize("fmt", ["legacy", pytest.param("object", marks=requires("Cache objects"))])
def test_uneven_cache_is_refused_before_any_layer_runs(model, fmt):
    """Checked up front: layers 0 and 1 must not append to the cache before layer 2 is found short."""
    cache = cropped(model, 2, fmt)
    before = cache_contents(cache)
    ran = []
    hooks = [block.attn.attention.register_forward_pre_hook(lambda *_: ran.append(1)) for block in model.transformer.h]
    try:
        expected = "cache layer 2 holds 4 tokens, but layer 0 holds 5"
        with pytest.raises(neofix.CacheLengthError, match=expected), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(input_ids=ones(2, 1), attention_mask=ones(2, 6), use_cache=True, **{cache_keyword(): cache})
    finally:
        for hook in hooks:
            hook.remove()
    assert ran == [], f"{len(ran)} attention layers ran before the error"
    assert_same_cache(before, cache)


@pytest.mark.skipif(not gpt_neo.ADAPTER.legacy_cache_rejected, reason="only transformers 4.54 and later reject tuple caches")
def test_strict_legacy_cache_is_an_error(model):
    neofix.configure(mode="strict")
    cache = legacy(cached(model))
    before = cache_contents(cache)
    with pytest.raises(neofix.NeofixError, match=r"legacy tuple cache .* no longer accepts: pass the Cache object"):
        model(input_ids=ones(2, 1), attention_mask=ones(2, 6), use_cache=True, **{cache_keyword(): cache})
    assert_same_cache(before, cache)


# -- generate: a length the model cannot reach is refused before any forward --------------------------------------


@pytest.fixture(scope="module")
def short():
    """A tiny GPT-Neo with 16 positions (float32: vanilla must run it on every release)."""
    return tiny_gpt_neo(seed=3, dtype=torch.float32, max_position_embeddings=16)


@pytest.mark.parametrize("length", [6, 16])
def test_generate_that_fits_exactly_runs(short, length):
    """The last generated token is never fed back: a prompt of ``n`` tokens may ask for ``P - n + 1`` new ones."""
    ids, mask = left_padded_batch([length, 3], vocab=96)
    new = 16 - length + 1
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=new, min_new_tokens=new)
    out = short.generate(ids, **kwargs)
    assert out.shape == (2, 17)
    assert torch.equal(out, reference_greedy(short, ids, mask, new))
    with neofix.unpatched():
        assert torch.equal(out, short.generate(ids, **kwargs))  # vanilla runs it too


# -- value checks: check_values=True compares given positions with the mask; the default stays sync-free ----------


def frozen_loop(model, ids, mask, steps):
    """A loop that feeds the same position every decode step (the prompt's last one): right length, wrong values."""
    keyword = cache_keyword()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=reference_positions(mask), use_cache=True)
        last = reference_positions(mask)[:, -1:]
        tokens = [out.logits[:, -1:].argmax(-1)]
        for _ in range(steps - 1):
            mask = torch.cat([mask, ones(mask.shape[0], 1)], -1)
            out = model(
                input_ids=tokens[-1], attention_mask=mask, position_ids=last, use_cache=True,
                **{keyword: output_cache(out)},
            )
            tokens.append(out.logits[:, -1:].argmax(-1))
    return torch.cat(tokens, -1)


STEPS = 6


@pytest.mark.parametrize("check_values", [False, True])
def test_frozen_positions_are_repaired(model, check_values):
    """The right shape, the wrong values: compared with the mask's on every cached step and repaired (on the device by
    default, after the step's one read with check_values), reported once, naming the row, the step and the value."""
    ids, mask = left_padded_batch([5, 3])
    expected = reference_greedy(model, ids, mask, STEPS)[:, ids.shape[1]:]
    neofix.configure(check_values=check_values)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = frozen_loop(model, ids, mask, STEPS)
    assert torch.equal(got, expected)
    repairs = [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]
    assert len(repairs) == 1, repairs  # reported once, not once per step
    assert re.search(
        r"position_ids\[0, 0\] is 4 at the step after 5 cached tokens, but the attention mask puts that real token of "
        r"row 0 at position 5",
        repairs[0],
    )
    assert "used the mask's positions" in repairs[0]
    with neofix.unpatched():
        assert not torch.equal(frozen_loop(model32_of(model), ids, mask, STEPS), expected)  # vanilla: wrong tokens


def model32_of(model):
    return tiny_gpt_neo(seed=0, dtype=torch.float32) if has("float64 mask bug") else model


@pytest.mark.parametrize("check_values", [False, True])
def test_frozen_positions_strict(model, check_values):
    """Strict mode raises at the first wrong step (it may read the device to do so)."""
    ids, mask = left_padded_batch([5, 3])
    neofix.configure(mode="strict", check_values=check_values)
    steps = Forwards(model)
    with steps, pytest.raises(neofix.PositionError) as raised:
        frozen_loop(model, ids, mask, STEPS)
    assert steps.count == 2  # the prefill, then the first decode step, which raises before its compute
    message = str(raised.value)
    assert re.search(r"position_ids\[0, 0\] is 4 at the step after 5 cached tokens", message)
    assert "positions must advance by one per real token" in message


@torch.no_grad()
def chunked_forwards(model, ids, mask, positions, split):
    """Logits of a prefill of ``ids[:, :split]`` (none when 0) and of the rest fed with its cache."""
    logits, kwargs = [], {}
    bounds = [0, split, ids.shape[1]] if split else [0, ids.shape[1]]
    for a, b in zip(bounds, bounds[1:]):
        out = model(
            input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=positions[:, a:b], use_cache=True, **kwargs
        )
        kwargs = {cache_keyword(): output_cache(out)}
        logits.append(out.logits)
    return logits


@pytest.mark.parametrize("split", [0, 2], ids=["prefill", "chunked"])
@pytest.mark.parametrize("mode", ["repair", "strict"])
def test_check_values_ignores_the_positions_of_pads(model32, mode, split):
    """check_values compares the positions of real tokens only: what a pad carries (transformers' generate gives
    pads position 1 up to 4.x; here 17) is neither reported nor repaired, so every column, pads included, computes
    exactly what vanilla computes from the same positions."""
    ids, mask = left_padded_batch([6, 3, 5])
    positions = reference_positions(mask).masked_fill(mask == 0, 17)
    neofix.configure(mode=mode, check_values=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", neofix.NeofixWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' own (tuple caches, 4.45 - 4.53)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        patched = chunked_forwards(model32, ids, mask, positions, split)
    with neofix.unpatched(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = chunked_forwards(model32, ids, mask, positions, split)
    assert len(patched) == len(plain) == (2 if split else 1)
    for got, want in zip(patched, plain):
        assert torch.equal(got, want)


def test_check_values_leaves_well_formed_generate_alone(model):
    ids, mask = left_padded_batch([6, 2, 4])
    neofix.configure(mode="strict", check_values=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", neofix.NeofixWarning)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, pad_token_id=0)
    assert torch.equal(out, reference_greedy(model, ids, mask, 5))


def counted_loop(model, steps=3, cache_format="native"):
    """A synced left-padded loop; returns (prefill conversions, [per decode step conversions])."""
    ids, mask = left_padded_batch([5, 3])
    keyword = cache_keyword()
    with torch.no_grad():
        with HostReads() as prefill:
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        decode = []
        for _ in range(steps):
            cache = output_cache(out)
            if cache_format == "legacy":
                cache = legacy(cache)
            mask = torch.cat([mask, ones(2, 1)], -1)
            token = out.logits[:, -1:].argmax(-1)
            with warnings.catch_warnings(), HostReads() as step:
                warnings.simplefilter("ignore")
                out = model(input_ids=token, attention_mask=mask, use_cache=True, **{keyword: cache})
            decode.append(step)
    return prefill, decode


@pytest.mark.parametrize("cache_format", ["native", "legacy"])
def test_default_decode_steps_add_no_conversion(model, cache_format):
    prefill, decode = counted_loop(model, cache_format=cache_format)
    assert prefill.by_neofix, "prefill must always check token ids"
    for step in decode:
        assert step.by_neofix == [], step.by_neofix
    # and the patched step converts exactly as often as vanilla's (vanilla 4.36 - 4.44 cannot run float64)
    if cache_format == "native" and not has("float64 mask bug"):
        with neofix.unpatched():
            _, plain = counted_loop(model, cache_format=cache_format)
        assert [len(step.reads) for step in decode] == [len(step.reads) for step in plain]


def test_check_values_decode_steps_do_check(model):
    """The positive control: with check_values=True each decode step synchronises once, in neofix."""
    neofix.configure(check_values=True)
    prefill, decode = counted_loop(model)
    assert prefill.by_neofix
    for step in decode:
        assert len(step.by_neofix) == 1, step.by_neofix


def test_default_is_documented():
    from neofix._config import _Settings

    fresh = _Settings()
    assert (fresh.mode, fresh.check_values) == ("repair", False)
    assert "``False`` (default)" in neofix.configure.__doc__


@pytest.mark.parametrize("name", [n for n in neofix.__all__ if n.endswith(("Error", "Warning"))])
def test_errors_carry_their_public_name(name):
    """Tracebacks print ``neofix.MaskLengthError: ...`` (the name users import), and errors survive pickling
    (multiprocessing, distributed workers)."""
    import pickle
    import traceback

    cls = getattr(neofix, name)
    assert f"{cls.__module__}.{cls.__qualname__}" == f"neofix.{name}"
    error = cls("attention_mask has 9 columns")
    assert traceback.format_exception_only(error) == [f"neofix.{name}: attention_mask has 9 columns\n"]
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is cls and again.args == error.args


@pytest.mark.parametrize("step", ["prefill", "decode step"])
@pytest.mark.parametrize("scalars", [True, False], ids=["cpu reads", "accelerator reads"])
def test_an_id_past_a_shrunk_vocabulary_is_named_on_the_new_size(scalars, step, monkeypatch):
    """The vocabulary neofix judges ids by is the model's as it is: after ``resize_token_embeddings`` shrank it
    (after a first forward, where neofix remembers the model's limits), an id the old vocabulary held is named
    against the new size, not passed over (the embedding's bare IndexError) as within the old one."""
    read_values_on(monkeypatch, scalars)
    model = tiny_gpt_neo(seed=4, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)  # the limits are remembered here
        vocab = model.config.vocab_size
        model.resize_token_embeddings(vocab - 6)
        if step == "prefill":
            call = dict(input_ids=torch.tensor([[1, 2, vocab - 3, 4]]))  # within the old vocabulary only
            where = r"input_ids\[0, 2\]"
        else:
            call = {"input_ids": torch.tensor([[vocab - 3]]), "attention_mask": torch.ones(1, 5, dtype=torch.long),
                    cache_keyword(): output_cache(out)}
            where = r"input_ids\[0, 0\]"
        with pytest.raises(neofix.TokenIdError) as raised:
            model(**call)
    assert re.search(rf"{where} is {vocab - 3}, outside the vocabulary: config.vocab_size is {vocab - 6}",
                     str(raised.value)), str(raised.value)
