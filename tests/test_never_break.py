"""What the patch must never break: everything transformers does with GPT-Neo behaves exactly as it does unpatched.

Each test runs the same thing patched and vanilla (``both``) on well-formed input and asserts identical results
(exact equality of losses, logits, gradients, outputs and files), that neofix emitted no ``NeofixWarning`` and
that the patched run warned and logged nothing the vanilla run did not (no deprecation warning from neofix).
The tracing and compilation paths are in ``test_never_break_tracing.py``; the helpers here serve both files.
"""

from __future__ import annotations

import filecmp
import logging
import os
import traceback
import warnings
from typing import Any, Callable, NamedTuple

import pytest
import torch

import neofix
from neofix.testing import reference_positions, tiny_gpt_neo, tiny_gpt_neo_config

from ._sync import read_values_on
from ._vanilla import Outcome, Raises, expected
from ._versions import TF_RELEASE, cache_keyword, legacy, output_cache, requires
from .loops import patched_and_vanilla

# -- running something patched and vanilla -------------------------------------------------------------------------


class Run(NamedTuple):
    """What one run returned (or raised), and every warning and log line it produced."""

    result: Any
    error: BaseException | None
    warnings: frozenset
    logs: frozenset


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.add(f"{record.name}: {record.getMessage()}")


def _forget_once_caches() -> None:
    """transformers logs some warnings once per process, torch too: forget them so both runs see every one."""
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):
        once.cache_clear()
    from torch.fx import _symbolic_trace

    fx_warning = getattr(_symbolic_trace, "is_fx_tracing_warning", None)
    if hasattr(fx_warning, "cache_clear"):
        fx_warning.cache_clear()


def capture(run: Callable[[], Any]) -> Run:
    """``run()`` with every warning and every transformers/torch log record of WARNING or above captured."""
    _forget_once_caches()
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("transformers", "torch")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.WARNING:
            logger.setLevel(logging.WARNING)
    result = error = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = run()
            except Exception as exc:  # noqa: BLE001 - a failure is a result too: vanilla and patched must agree
                error = exc
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    return Run(
        result,
        error,
        frozenset((w.category.__name__, str(w.message)) for w in caught),
        frozenset(handler.messages),
    )


def both(run: Callable[[], Any]) -> tuple[Run, Run]:
    """``run()`` vanilla (unpatched), then patched, each captured: ``(patched, vanilla)``.

    Vanilla runs first, so that what transformers and torch warn about once per process (on a first import, a
    first jit.script...) lands in the vanilla run: the patched run must not warn about anything vanilla did not.
    """
    return patched_and_vanilla(lambda: capture(run), vanilla_first=True)


def assert_adds_nothing(patched: Run, plain: Run) -> None:
    """No NeofixWarning, and no warning or log line that vanilla transformers does not produce itself."""
    assert not [w for w in patched.warnings if w[0] == "NeofixWarning"], patched.warnings
    assert patched.warnings <= plain.warnings, patched.warnings - plain.warnings
    assert patched.logs <= plain.logs, patched.logs - plain.logs


def assert_same(a: Any, b: Any, where: str = "output") -> None:
    """Exact equality of (nested) outputs: tensors bit for bit, caches layer by layer, everything else by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: differs by up to {(a.double() - b.double()).abs().max().item()}"
    elif hasattr(a, "keys") and hasattr(b, "keys"):  # ModelOutput, dict
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a.keys())} vs {list(b.keys())}"
        for key in a.keys():
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {type(a)}[{len(a)}] vs {type(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif a is None or isinstance(a, (str, bytes, int, float, bool)):
        assert a == b, f"{where}: {a!r} vs {b!r}"
    else:  # a Cache object
        assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
        assert_same(legacy(a), legacy(b), f"{where} (cache)")


def assert_ran(patched: Run, plain: Run) -> None:
    """Both runs completed.  A never-break test must prove the path ran: a path that fails vanilla and patched
    alike (the same error twice) shows nothing about the patch."""
    for name, run in (("vanilla", plain), ("patched", patched)):
        if run.error is not None:
            trace = "".join(traceback.format_exception(type(run.error), run.error, run.error.__traceback__))
            raise AssertionError(f"the {name} run failed, so the path under test did not run:\n{trace}")


def assert_identical(patched: Run, plain: Run) -> None:
    """Both runs completed with the same result, and the patched one added nothing to what transformers warns
    about."""
    assert_ran(patched, plain)
    assert_same(patched.result, plain.result)
    assert_adds_nothing(patched, plain)


# -- inputs ----------------------------------------------------------------------------------------------------------

BATCH, LENGTH = 3, 10


def token_ids(batch: int = BATCH, length: int = LENGTH, seed: int = 0) -> torch.Tensor:
    """Token ids in [1, 96): never the pad id 0."""
    return torch.randint(1, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def right_padded(lengths=(10, 6, 8), seed=0):
    """input_ids and mask of rows of the given lengths, right-padded with pad id 0."""
    ids = token_ids(len(lengths), max(lengths), seed)
    mask = torch.ones_like(ids)
    for row, length in enumerate(lengths):
        ids[row, length:] = 0
        mask[row, length:] = 0
    return ids, mask


def left_padded(lengths=(10, 6, 8), seed=0):
    ids = token_ids(len(lengths), max(lengths), seed)
    mask = torch.ones_like(ids)
    for row, length in enumerate(lengths):
        ids[row, : max(lengths) - length] = 0
        mask[row, : max(lengths) - length] = 0
    return ids, mask


def fresh(cls_name: str = "GPTNeoForCausalLM", seed: int = 0, dtype=torch.float32, **overrides: Any) -> Any:
    """A freshly initialised tiny GPT-Neo model of any head (weights depend on the seed only)."""
    import transformers

    cls = getattr(transformers, cls_name)
    config = tiny_gpt_neo_config(**overrides)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = cls(config)
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype).eval()


def grads(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# -- training and loss ------------------------------------------------------------------------------------------------

DROPOUT = dict(embed_dropout=0.1, attention_dropout=0.1, resid_dropout=0.1)


def train_step(model, **inputs):
    """One training forward and backward from a fixed seed: the loss, the logits and every parameter gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # dropout draws the same masks patched and vanilla (neofix draws no random numbers)
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), grads(model)


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("inputs", ["ids", "mask", "right-padded", "position_ids"])
def test_training_loss_and_gradients(inputs, dropout):
    model = fresh(**(DROPOUT if dropout else {})).train()
    if inputs == "right-padded":
        ids, mask = right_padded()
        kwargs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    else:
        ids = token_ids()
        kwargs = dict(input_ids=ids, labels=ids)
        if inputs in ("mask", "position_ids"):
            kwargs["attention_mask"] = torch.ones_like(ids)
        if inputs == "position_ids":
            kwargs["position_ids"] = reference_positions(kwargs["attention_mask"])
    patched, plain = both(lambda: train_step(model, **kwargs))
    assert_identical(patched, plain)
    loss, _, gradients = patched.result
    assert torch.isfinite(loss) and len(gradients) == len(list(model.parameters()))


def test_gradient_checkpointing():
    model = fresh(**DROPOUT)
    # transformers 5.x renamed it (the old name warns FutureWarning); both switch the same flag
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    assert model.transformer.gradient_checkpointing
    ids, mask = right_padded()
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    patched, plain = both(lambda: train_step(model, **kwargs))
    assert_identical(patched, plain)


@pytest.fixture(scope="module")
def model():
    """A tiny float32 GPT-Neo with a sharpened output layer (greedy decoding never sits on a near-tie).

    float32, not the suite's float64: transformers 4.36 - 4.44 cannot run GPT-Neo in float64 with an attention mask
    ("value cannot be converted to type float without overflow", which neofix repairs), and a comparison with a
    vanilla run needs vanilla to run.  Patched and vanilla run the same ops, so float32 results are equal bit for bit.
    """
    return tiny_gpt_neo(seed=0, dtype=torch.float32)


def test_output_attentions_and_hidden_states(model):
    ids, mask = right_padded()

    def run():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)

    patched, plain = both(run)
    assert_identical(patched, plain)
    out = patched.result
    layers = model.config.num_layers
    assert len(out.attentions) == layers and len(out.hidden_states) == layers + 1


@pytest.mark.parametrize("use_cache", [False, True])
def test_return_dict_false(model, use_cache):
    ids = token_ids()

    def run():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=use_cache,
                         return_dict=False)

    patched, plain = both(run)
    assert_identical(patched, plain)
    assert isinstance(patched.result, tuple)
    loss, logits = patched.result[:2]
    assert loss.dim() == 0 and logits.shape == (*ids.shape, model.config.vocab_size)


# -- classification and QA heads ------------------------------------------------------------------------------------


def test_sequence_classification_right_padding():
    model = fresh("GPTNeoForSequenceClassification", num_labels=3)
    ids, mask = right_padded()
    labels = torch.tensor([0, 2, 1])

    def run():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, labels=labels)

    patched, plain = both(run)
    assert_identical(patched, plain)
    assert patched.result.logits.shape == (3, 3)


def test_sequence_classification_left_padding_with_positions():
    model = fresh("GPTNeoForSequenceClassification", num_labels=3)
    ids, mask = left_padded()

    def run():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, position_ids=reference_positions(mask),
                         labels=torch.tensor([1, 0, 2]))

    patched, plain = both(run)
    assert_identical(patched, plain)


def test_sequence_classification_training():
    model = fresh("GPTNeoForSequenceClassification", num_labels=3).train()
    ids, mask = right_padded()
    patched, plain = both(lambda: train_step(model, input_ids=ids, attention_mask=mask, labels=torch.tensor([2, 1, 0])))
    assert_identical(patched, plain)


@requires("left-padded sequence classification")
def test_sequence_classification_left_padding_without_positions_is_repaired():
    """The one deliberate difference: without position_ids, neofix derives them from the mask, so a left-padded
    row is classified exactly like the same text unpadded; vanilla gives its padded rows shifted positions."""
    model = fresh("GPTNeoForSequenceClassification", num_labels=3)
    lengths = (10, 6, 8)
    ids, mask = left_padded(lengths)

    def run():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits

    patched, plain = both(run)
    assert_ran(patched, plain)
    # the change is said, once: the first left-padded forward without a cache whose positions neofix derives
    said = [message for kind, message in patched.warnings if kind == "NeofixWarning"]
    assert len(said) == 1 and "row 1 of this forward is left-padded and no position_ids were given" in said[0], said
    assert "neofix.configure(uncached_positions='transformers')" in said[0]
    assert {w for w in patched.warnings if w[0] != "NeofixWarning"} <= plain.warnings
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids[row:row + 1, -n:]).logits for row, n in enumerate(lengths)])
    # a padded and an unpadded row differ by float32 rounding only
    torch.testing.assert_close(patched.result, alone, rtol=1e-4, atol=1e-4)
    for row in (1, 2):  # the padded rows
        assert not torch.allclose(plain.result[row], alone[row], rtol=1e-2, atol=1e-2), "vanilla is right already?"
    assert torch.equal(patched.result[0], plain.result[0])  # the unpadded row: identical


@pytest.mark.parametrize("head", ["GPTNeoForSequenceClassification", "GPTNeoForCausalLM"])
def test_transformers_positions_on_request(head):
    """``configure(uncached_positions="transformers")``: forwards without a cache keep transformers' own positions,
    left padding included, bit for bit as unpatched (a model fine-tuned on them), and nothing is said."""
    model = fresh(head, **({"num_labels": 3} if "Classification" in head else {}))
    ids, mask = left_padded((10, 6, 8))
    labels = ids.masked_fill(mask == 0, -100) if head == "GPTNeoForCausalLM" else torch.tensor([2, 1, 0])

    def run():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, labels=labels)

    neofix.configure(uncached_positions="transformers")
    patched, plain = both(run)
    assert_identical(patched, plain)
    neofix.configure(uncached_positions="mask")
    derived = capture(run)
    assert not torch.equal(derived.result.logits, plain.result.logits)  # the default changes them: the setting matters


@requires("GPTNeoForQuestionAnswering")
def test_question_answering():
    model = fresh("GPTNeoForQuestionAnswering")
    ids, mask = right_padded()
    labels = dict(start_positions=torch.tensor([1, 2, 0]), end_positions=torch.tensor([4, 5, 3]))

    def run():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, **labels)

    patched, plain = both(run)
    assert_identical(patched, plain)
    assert patched.result.start_logits.shape == ids.shape
    model.train()
    patched, plain = both(lambda: _qa_train_step(model, ids, mask, labels))
    assert_identical(patched, plain)


def _qa_train_step(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, **labels)
    out.loss.backward()
    return out.loss.detach(), grads(model)


@requires("GPTNeoForTokenClassification")
def test_token_classification():
    model = fresh("GPTNeoForTokenClassification", num_labels=5, classifier_dropout=0.0)
    ids, mask = right_padded()
    labels = torch.randint(0, 5, ids.shape, generator=torch.Generator().manual_seed(3)).masked_fill(mask == 0, -100)

    def run():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, labels=labels)

    patched, plain = both(run)
    assert_identical(patched, plain)
    assert patched.result.logits.shape == (*ids.shape, 5)
    model.train()
    patched, plain = both(lambda: train_step(model, input_ids=ids, attention_mask=mask, labels=labels))
    assert_identical(patched, plain)


# -- pipelines ----------------------------------------------------------------------------------------------------------


def word_tokenizer():
    """A fast word-level tokenizer over the tiny model's 96 ids ("<pad>" = 0 = eos, "w1" ... "w94", "<unk>" = 95),
    built locally: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, 95)}, "<unk>": 95}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<pad>", bos_token="<pad>", unk_token="<unk>"
    )


PROMPTS = ["w5 w17 w3 w90 w44 w12", "w8 w61", "w33 w2 w71 w9"]


def test_text_generation_pipeline(model):
    import transformers

    def run():
        tokenizer = word_tokenizer()
        tokenizer.padding_side = "left"
        generator = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
        alone = [generator(prompt, max_new_tokens=6, do_sample=False) for prompt in PROMPTS]
        batched = generator(PROMPTS, max_new_tokens=6, do_sample=False, batch_size=3)  # left-padded
        return alone, batched

    patched, plain = both(run)
    assert_identical(patched, plain)
    alone, batched = patched.result
    texts = [row[0]["generated_text"] for row in alone]
    assert all(text.startswith(prompt) and len(text) > len(prompt) for text, prompt in zip(texts, PROMPTS))
    assert [row[0]["generated_text"] for row in batched] == texts


def test_text_classification_pipeline():
    import transformers

    model = fresh(
        "GPTNeoForSequenceClassification",
        num_labels=3,
        id2label={0: "neg", 1: "neu", 2: "pos"},
        label2id={"neg": 0, "neu": 1, "pos": 2},
    )

    def run():
        classifier = transformers.pipeline(
            "text-classification", model=model, tokenizer=word_tokenizer(), device="cpu", top_k=None
        )
        return [classifier(prompt) for prompt in PROMPTS], classifier(PROMPTS, batch_size=3)  # right-padded

    patched, plain = both(run)
    assert_identical(patched, plain)
    alone, batched = patched.result
    for one, row in zip(alone, batched):
        one = one[0] if one and isinstance(one[0], list) else one  # a single text's scores come nested up to 4.3x
        assert [entry["label"] for entry in one] == [entry["label"] for entry in row]
        for a, b in zip(one, row):
            assert abs(a["score"] - b["score"]) < 1e-6


# -- save_pretrained / from_pretrained ------------------------------------------------------------------------------


def _files(folder) -> dict:
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = path
    return found


def test_save_and_load_round_trip(tmp_path):
    import transformers

    # tied embeddings, as in every GPT-Neo checkpoint (up to 4.30 an untied lm_head is not even saved)
    model = fresh(dtype=torch.float32, tie_word_embeddings=True)
    ids = token_ids()

    def run(tag):
        def save_and_load():
            folder = tmp_path / tag
            model.save_pretrained(folder)
            torch.manual_seed(0)  # anything from_pretrained initialises, it initialises alike in both runs
            loaded = transformers.GPTNeoForCausalLM.from_pretrained(folder).eval()
            with torch.no_grad():
                logits = loaded(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            return folder, loaded.state_dict(), logits

        return save_and_load

    with neofix.unpatched():
        plain = capture(run("vanilla"))
    patched = capture(run("patched"))
    assert_ran(patched, plain)
    assert_adds_nothing(patched, plain)
    patched_files, plain_files = _files(patched.result[0]), _files(plain.result[0])
    assert sorted(patched_files) == sorted(plain_files) and patched_files
    for name, path in patched_files.items():
        assert filecmp.cmp(path, plain_files[name], shallow=False), f"{name} differs patched vs vanilla"
    original = model.state_dict()
    for state in (patched.result[1], plain.result[1]):
        assert sorted(state) == sorted(original)
        for key, value in original.items():
            assert torch.equal(state[key], value), key
    assert_same(patched.result[2], plain.result[2], "logits after loading")
    with torch.no_grad():
        assert torch.equal(patched.result[2], model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits)


# -- nothing extra in the logs --------------------------------------------------------------------------------------------


def test_forward_and_generate_log_nothing_new(model):
    """A patched forward, training step and generate log no line (transformers' or torch's) vanilla does not."""
    ids, mask = right_padded()
    trainable = fresh()

    def run():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
            model.generate(ids[:, :4], attention_mask=torch.ones_like(ids[:, :4]), max_new_tokens=3,
                           do_sample=False, pad_token_id=0)
        train_step(trainable.train(), input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))

    patched, plain = both(run)
    assert_ran(patched, plain)
    assert_adds_nothing(patched, plain)


# -- a batch of no rows ------------------------------------------------------------------------------------------------

def assert_vanilla_outcome(plain: Run, case: str) -> Outcome:
    """The vanilla run ended as tests/_vanilla.py says for this release: it raised exactly the recorded exception
    class (not a subclass) with the fragment in its message, or it ran.  Returns the outcome."""
    outcome = expected(case)
    error = plain.error
    where = f"vanilla transformers {'.'.join(map(str, TF_RELEASE))} on {case!r}: expected {outcome}"
    got = "it ran" if error is None else f"got {type(error).__name__}: {error}"
    if isinstance(outcome, Raises):
        assert error is not None and type(error) is outcome.error and outcome.fragment in str(error), f"{where}, {got}"
    else:
        assert error is None, f"{where}, {got}"
    return outcome


def assert_fails_as_vanilla(patched: Run, plain: Run) -> None:
    """The patched run raised vanilla's error unchanged: the same class and message, raised along the same frames of
    transformers and torch, with neofix's wrapper among them (neofix ran, and left the refusal to transformers: no
    ``NeofixError``, no error of its own); and it warned and logged nothing vanilla did not."""
    assert plain.error is not None and patched.error is not None, (patched.error, plain.error)
    assert type(patched.error) is type(plain.error), (patched.error, plain.error)
    assert str(patched.error) == str(plain.error)
    ours = os.path.dirname(neofix.__file__) + os.sep
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(patched.error.__traceback__)]
    assert any(filename.startswith(ours) for filename, _, _ in frames), "the patched run did not go through neofix"
    mutmut = f"{os.sep}mutmut{os.sep}"  # (mutation testing's trampolines call neofix's functions: not transformers')
    theirs = [frame for frame in frames if not frame[0].startswith(ours) and mutmut not in frame[0]]
    vanilla_frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(plain.error.__traceback__)]
    assert theirs == vanilla_frames, f"raised from {frames[-1]}, not from where vanilla raises it: {vanilla_frames[-1]}"
    assert_adds_nothing(patched, plain)


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@pytest.mark.parametrize("inputs", ["ids", "ids and mask", "ids, mask and positions"])
def test_a_batch_of_no_rows_runs_or_fails_as_vanilla(path, inputs, monkeypatch):
    """``input_ids`` of shape (0, 5), on both paths of neofix's reads: vanilla's exact outcome on this release is
    asserted first (tests/_vanilla.py: the logits of no rows, or 4.26 - 4.30's ``ValueError`` once a mask is given).
    Where vanilla runs, the patched run runs too, with the same logits of no rows; where it fails, the patched run
    fails with vanilla's error unchanged.  neofix, which has no value to read, changes neither (a reduction over no
    rows used to raise ``IndexError`` on the accelerator path and wherever positions were given)."""
    model = fresh()
    call = {"input_ids": torch.zeros((0, 5), dtype=torch.long)}
    if inputs != "ids":
        call["attention_mask"] = torch.ones((0, 5), dtype=torch.long)
    if inputs == "ids, mask and positions":
        call["position_ids"] = torch.zeros((0, 5), dtype=torch.long)
    read_values_on(monkeypatch, path == "cpu")

    def run():
        with torch.no_grad():
            return model(**call)

    patched, plain = both(run)
    if isinstance(assert_vanilla_outcome(plain, f"{inputs} of no rows"), Raises):
        assert_fails_as_vanilla(patched, plain)
        return
    assert_identical(patched, plain)
    assert patched.result.logits.shape == (0, 5, 96)


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@pytest.mark.parametrize("given", [False, True])
def test_a_chunk_of_no_rows_runs_or_fails_as_vanilla(path, given, monkeypatch):
    """A chunk of no rows (2 tokens) after the cache of a prefill of no rows (3 tokens), with a mask over both (and
    the chunk's positions): vanilla's exact outcome on this release is asserted first (tests/_vanilla.py).  Where
    vanilla computes the logits of no rows (4.36 - 5.0), so does neofix, reading nothing (on 4.57 and 5.0 it refused
    the chunk with ``MaskLengthError``, taking the 0 tokens such a cache layer counts for its length); where vanilla
    fails (4.26 - 4.30 refuse the prefill's batch of no rows; 5.10 on, the chunk's mask of 2 columns against 5 keys),
    the patched run fails with vanilla's error unchanged, neofix leaving the cache of unknown length to
    transformers."""
    model = fresh()
    ids = torch.zeros((0, 5), dtype=torch.long)
    mask = torch.ones((0, 5), dtype=torch.long)
    read_values_on(monkeypatch, path == "cpu")

    def run():
        with torch.no_grad():
            cache = output_cache(model(input_ids=ids[:, :3], attention_mask=mask[:, :3], use_cache=True))
            chunk = {"input_ids": ids[:, 3:], "attention_mask": mask, cache_keyword(): cache}
            if given:
                chunk["position_ids"] = torch.zeros((0, 2), dtype=torch.long)
            return model(**chunk).logits

    patched, plain = both(run)
    if isinstance(assert_vanilla_outcome(plain, "a chunk of no rows after a prefill of no rows"), Raises):
        assert_fails_as_vanilla(patched, plain)
        return
    assert_identical(patched, plain)
    assert patched.result.shape == (0, 2, 96)


# -- a cache that drops tokens -----------------------------------------------------------------------------------------


@requires("sink caches")
@requires("attention layers get the whole cache")  # (before 4.45 these loops fail inside transformers, vanilla too)
@pytest.mark.parametrize("family", ["gpt_neo", "llama"])
def test_a_sink_cache_is_passed_on_as_given(family):
    """A ``SinkCache`` keeps its first tokens and the last ones: past its window it holds fewer tokens than the mask
    covers, so the mask's width and the positions cannot be judged against it (the mask was refused as ambiguous, and
    a hand loop's right positions were "repaired" to the mask cut down).  Steps over one are transformers' own: a
    loop passing the mask's positions past the window, and generate on a left-padded batch, compute what they compute
    unpatched, bit for bit, and nothing is said."""
    from transformers import SinkCache

    from neofix.testing import tiny_model

    model = tiny_gpt_neo(seed=0) if family == "gpt_neo" else tiny_model("llama", seed=0, dtype=torch.float32)
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0

    @torch.no_grad()
    def loop():
        cache, fed, full, logits = SinkCache(window_length=12, num_sink_tokens=2), ids[:1], mask[:1], []
        for _ in range(6):  # 9 tokens, then 5 more: past the window of 12 from the fourth step
            positions = reference_positions(full)[:, -fed.shape[1]:]
            out = model(input_ids=fed, attention_mask=full, position_ids=positions, past_key_values=cache, use_cache=True)
            cache, fed = out.past_key_values, out.logits[:, -1:].argmax(-1)
            logits.append(out.logits)
            full = torch.cat([full, full.new_ones(1, 1)], -1)
        return logits

    def generate():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
            past_key_values=SinkCache(window_length=12, num_sink_tokens=2),
        )

    for run in (loop, generate):
        assert_identical(*both(run))
