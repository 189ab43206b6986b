"""``neofix doctor --model DIR`` on a saved GPT-Neo checkpoint shaped like a small real one (issue 36, item 5).

256 positions, a local window of 16, random weights, a tokenizer trained in code (no download), and a
``generation_config.json`` as trained checkpoints carry it.  "generate past the table, EOS in time" asks generate
for 10 new tokens 6 positions short of the table's end, with as EOS the first token plain greedy full recompute
gives.  A checkpoint whose generation settings hold EOS back (``min_new_tokens``) does not emit it in time: vanilla
fails at the step that passes the table with a raw error, neofix raises SequenceTooLongError there, as the step
contract says.  The doctor judged that WRONG ("Please report this"), because its expectation came from what the
tiny random model does; it now comes from what full recompute does on the checkpoint.
"""

from __future__ import annotations

import pytest
import torch

import neofix
from neofix import _doctor
from neofix._doctor import _scenarios
from neofix._doctor._scenarios import SCENARIOS, Context

KEY = "generate_eos_near_the_end"
SCENARIO = {scenario.key: scenario for scenario in SCENARIOS}[KEY]


def _tokenizer(folder):
    """A byte-level BPE tokenizer trained here on a few sentences, saved with the checkpoint (as users save theirs)."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["<|endoftext|>", "<unk>"])
    tokenizer.train_from_iterator([f"the quick brown fox jumps over the lazy dog {i}" for i in range(50)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)
    return len(fast)


def checkpoint(folder, *, min_new_tokens=None, seed=3):
    """Save a GPT-Neo checkpoint of 256 positions and window 16 into ``folder``; return the folder."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    vocab = _tokenizer(folder)
    config = GPTNeoConfig(
        vocab_size=vocab, max_position_embeddings=256, hidden_size=32, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]], window_size=16, intermediate_size=64, bos_token_id=0,
        eos_token_id=0,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = GPTNeoForCausalLM(config).eval()
    finally:
        torch.random.set_rng_state(state)
    if min_new_tokens is not None:  # a generation_config.json of its own (not one derived from config.json)
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, min_new_tokens=min_new_tokens)
    model.save_pretrained(folder)
    return folder


def row(report, key=KEY):
    return next(r for r in report.rows if r.key == key)


@pytest.mark.parametrize("strict", [False, True], ids=["repair", "strict"])
def test_checkpoint_without_eos_in_time(tmp_path, strict):
    """min_new_tokens=4: EOS may not come before the 7 new tokens that fit.  Full recompute does not reach it before
    the table's end, so the right outcome is SequenceTooLongError (the 8th step would pass the table), not tokens."""
    report = _doctor.run(str(checkpoint(tmp_path / "no-eos", min_new_tokens=4)), strict=strict, others=False)
    found = row(report)
    assert found.expected == "clear error: SequenceTooLongError", found
    assert found.neofix.kind == "clear_error" and found.neofix.error_class == "SequenceTooLongError", found
    assert found.vanilla.kind == "error", found  # vanilla: a raw error at the step past the table
    assert found.title == "generate past the table, no EOS in time"
    assert found.right, found
    assert report.all_right, [r for r in report.rows if not r.right]
    assert neofix.is_patched()


def test_checkpoint_with_eos_in_time(tmp_path):
    """The same checkpoint without the setting: EOS comes at once, generate completes, tokens identical to vanilla."""
    report = _doctor.run(str(checkpoint(tmp_path / "eos")), others=False)
    found = row(report)
    assert found.expected == "reference tokens, identical to vanilla", found
    assert found.title == "generate past the table, EOS in time"
    assert found.vanilla.kind == "correct" and found.neofix.kind == "correct", found
    assert report.all_right, [r for r in report.rows if not r.right]


def test_the_expectation_comes_from_full_recompute_on_the_model(tmp_path):
    """The scenario as the context's model expects it: unchanged where full recompute reaches EOS in time, the
    SequenceTooLongError variant where it does not; the reference is computed once, on vanilla transformers."""
    from transformers import AutoModelForCausalLM

    folder = checkpoint(tmp_path / "no-eos", min_new_tokens=4)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    context = Context(model)
    adapted = SCENARIO.for_family(context)
    assert adapted == SCENARIO._replace(
        title="generate past the table, no EOS in time", reference=None, error=neofix.SequenceTooLongError,
        strict_error=neofix.SequenceTooLongError, parity=False, adapt=SCENARIO.adapt,
    )
    tokens, in_time = _scenarios._eos_near_the_end_outcome(context)
    _, eos = _scenarios._near_the_end(context)
    assert not in_time and tokens.shape == (1, _scenarios.NEAR_THE_END + 1) and eos not in tokens.tolist()[0]
    with pytest.raises(neofix.SequenceTooLongError):
        SCENARIO.run(context)
    assert neofix.is_patched()

    model.generation_config.min_new_tokens = None
    context = Context(model)
    assert SCENARIO.for_family(context) is SCENARIO
    assert torch.equal(SCENARIO.run(context), torch.tensor([[eos]]))
    assert torch.equal(SCENARIO.reference(context), torch.tensor([[eos]]))
