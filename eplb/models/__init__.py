"""Real model architectures behind the :class:`~eplb.model.MixtureOfExperts` protocol.

:mod:`eplb.models.hf` serves Hugging Face transformers MoE models under elastic EP;
:mod:`eplb.models.kernel` is the experts kernel that keeps their output bitwise identical to the
unsharded model; :mod:`eplb.models.config` the ``model:`` config types.
"""

from eplb.models.config import (
    ARCHITECTURES,
    HFModelConfig,
    ModelSpec,
    ProbeConfig,
    ReferenceModelConfig,
)

__all__ = ["ARCHITECTURES", "HFModelConfig", "ModelSpec", "ProbeConfig", "ReferenceModelConfig"]
