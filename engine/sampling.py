"""Transitional: the old home of `SamplingParams`, kept torch-free for cluster/ imports.

`SamplingParams` and `MAX_LOGPROBS` now live in `sampling_params` (torch-free) and
the sampler in `sampler` (torch). Import them from `pagefleet.engine`; this module
goes once nothing imports `pagefleet.engine.sampling`.
"""

from __future__ import annotations

from .sampling_params import MAX_LOGPROBS, SamplingParams

__all__ = ["MAX_LOGPROBS", "SamplingParams"]
