"""pdserve: prefill/decode-disaggregated LLM serving with the KV cache as a schedulable object.

Imports are lazy so that `import pdserve.core` (and the simulator) never loads torch.
"""

from __future__ import annotations

from pdserve.version import __version__
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from pdserve.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from pdserve.core.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
