"""neofix's own time per decode step on the 125M shape, measured in place: the model-forward wrapper around a stand-in
for transformers' forward that returns at once, so the time is neofix's alone (read the call, align, call, end).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_own_decode.py

The cache is a real ``DynamicCache`` shaped like gpt-neo-125M's (12 layers, 12 heads of width 64, 48 cached tokens);
the steps are generate's (positions it built from the mask) and a hand loop's (no positions: derived on the device).
Prints the median of many calls; divide by a 125M decode step's time (``bench_decode.py``) for the ratio.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
from transformers import GPTNeoConfig, GPTNeoModel
from transformers.cache_utils import DynamicCache

import neofix  # noqa: F401  (registers the patch)
from neofix import _wrappers
from neofix._families import FAMILIES


def stand_in(self, input_ids=None, past_key_values=None, attention_mask=None, token_type_ids=None,
             position_ids=None, head_mask=None, inputs_embeds=None, use_cache=None, output_attentions=None,
             output_hidden_states=None, return_dict=None, cache_position=None, **kwargs):
    return None


def main() -> None:
    torch.set_num_threads(1)
    config = GPTNeoConfig(num_layers=12, hidden_size=768, num_heads=12, attention_types=[[["global", "local"], 6]],
                          window_size=256, vocab_size=50257, max_position_embeddings=2048)
    with torch.device("meta"):
        model = GPTNeoModel(config)
    adapter = FAMILIES["gpt_neo"].load_adapter()
    forward = _wrappers.make_model_forward(functools.wraps(GPTNeoModel.forward.__wrapped__)(stand_in), adapter)
    for batch in (1, 4):
        cache = DynamicCache(config=config) if "config" in DynamicCache.__init__.__code__.co_varnames else DynamicCache()
        for layer in range(12):
            keys = torch.zeros(batch, 12, 48, 64)
            cache.update(keys, keys, layer)
        mask = torch.ones(batch, 49, dtype=torch.long)
        mask[1:, :5] = 0
        ids = torch.ones(batch, 1, dtype=torch.long)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
        _wrappers._trust(positions)
        keyword = "cache" if "cache" in GPTNeoModel.forward.__wrapped__.__code__.co_varnames else "past_key_values"
        for name, call in (
            ("generate's step", {"position_ids": positions}),
            ("hand loop, no positions", {}),
        ):
            kwargs = {"attention_mask": mask, keyword: cache, "use_cache": True, **call}
            times = []
            for _ in range(3000):
                start = time.perf_counter_ns()
                forward(model, ids, **kwargs)
                times.append(time.perf_counter_ns() - start)
            median = statistics.median(times[500:]) / 1000
            print(f"batch {batch}, {name:<24} own {median:7.1f} us per decode step")


if __name__ == "__main__":
    main()
