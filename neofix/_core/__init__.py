"""The family-neutral, version-free decoding-step contract.

One step is read into a :class:`StepInputs` and a :class:`CacheView` (by the model family's adapter); :func:`align`
checks and aligns it in named steps and returns an :class:`Aligned` (tensors to call the model with, and the
repairs made, as data) or raises a :class:`~neofix.NeofixError`.  Nothing here knows a transformers release or a
model family.
"""

from ._align import _align_padding_mask as align_padding_mask
from ._align import align, keeps_every_rule, raise_cache_length_error
from ._types import NO_CACHE, Aligned, CacheView, Limits, Policy, Positions, Repair, Report, StepInputs
from ._values import derive_positions, explain_index_error

__all__ = [
    "NO_CACHE",
    "Aligned",
    "CacheView",
    "Limits",
    "Policy",
    "Positions",
    "Repair",
    "Report",
    "StepInputs",
    "align",
    "align_padding_mask",
    "derive_positions",
    "explain_index_error",
    "keeps_every_rule",
    "raise_cache_length_error",
]
