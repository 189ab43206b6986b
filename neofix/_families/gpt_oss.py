"""GPT-OSS's adapter (transformers 4.55 and later: patched from its arrival).

Gemma3's shape (:mod:`neofix._families.gemma3`) with a sparse mixture of experts in place of each block's MLP and a
learned attention sink per head, neither of which changes anything neofix reads: rotary positions, grouped-query
attention, ``head_dim`` from the config, sliding-window layers (``sliding_window``) alternating with full ones
(``layer_types``), no position table; measured on 4.55, 4.57, 5.0 and 5.25 with
``neofix.testing.tiny_model("gpt_oss")``.  Its attention is eager (the sink takes no sdpa kernel).  The forward
builds its own ``DynamicCache``, which keeps every token up to 4.55 and, from 4.56, only the window's in its
sliding-window layers (counting every token); legacy tuple caches are rejected on every release that has it.  The
router's auxiliary loss (``output_router_logits``) is computed by ``GptOssForCausalLM`` from the mask it is given,
outside the patched forward: neofix leaves it as transformers computes it.
"""

from __future__ import annotations

from .._core import Positions
from . import GPT_OSS
from ._contract import Adapter, make_layers, read_window_cache
from .llama import rotary_limits

ADAPTER = Adapter(
    family=GPT_OSS,
    positions=Positions.ROTARY,
    limits=rotary_limits(),  # the config's head_dim on every release
    layers=make_layers("layers", run="num_hidden_layers"),
    read_cache=read_window_cache,
    legacy_cache_rejected=True,
)
