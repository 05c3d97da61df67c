"""Which model a deployment serves: the reference MoE or a Hugging Face MoE architecture.

``model: {kind: reference, num_experts: 16, ...}`` (the default kind, so existing configs keep
working), ``model: {kind: hf, path: DIR}`` (a local checkpoint written by ``save_pretrained``) or
``model: {kind: hf, architecture: NAME, config: {...}, seed: N}`` (a tiny random model, for tests
and scenarios). :data:`ModelSpec` is the union a deployment can embed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from eplb.model import ModelShape

__all__ = ["ARCHITECTURES", "HFModelConfig", "ModelSpec", "ProbeConfig", "ReferenceModelConfig", "tiny_config"]

_BASE: dict[str, Any] = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False}

#: The architectures served, each with the config of a tiny model (2 layers, hidden 32, 8 experts, top-2):
#: a user's ``config`` is laid over it. Every layer is an MoE layer so that both layers move.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2_moe": {"intermediate_size": 64, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
                      "num_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "head_dim": 8},
    "mixtral": {"intermediate_size": 16, "num_local_experts": 8, "num_experts_per_tok": 2},
    "olmoe": {"intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "eos_token_id": None, "pad_token_id": None},
    "deepseek_v3": {"intermediate_size": 64, "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
                        "num_key_value_heads": 4,
                        "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 0, "kv_lora_rank": 16,
                        "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "gpt_oss": {"intermediate_size": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 8, "sliding_window": 16,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "glm4_moe": {"intermediate_size": 64, "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
                     "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 0, "head_dim": 8},
    "qwen3_next": {"intermediate_size": 64, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
                       "num_experts": 8, "num_experts_per_tok": 2, "head_dim": 8, "linear_num_value_heads": 4,
                       "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                       "layer_types": ["linear_attention", "full_attention"]},
}


def tiny_config(architecture: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tiny config of ``architecture`` with ``overrides`` laid over it."""
    return {**_BASE, **ARCHITECTURES[architecture], **(overrides or {})}


class ProbeConfig(BaseModel):
    """The fixed probe batch: ``batch`` seeded prompts of ``prompt_len`` tokens, ``new_tokens`` greedy steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch: int = Field(4, ge=1)
    prompt_len: int = Field(6, ge=1)
    new_tokens: int = Field(4, ge=1)
    seed: int = 1234


class HFModelConfig(BaseModel):
    """A Hugging Face MoE model: a local checkpoint directory or a tiny random one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["hf"] = "hf"
    path: str | None = Field(None, description="a directory written by save_pretrained (safetensors)")
    architecture: str | None = Field(None, description="model_type of a tiny random model: " + ", ".join(ARCHITECTURES))
    config: dict[str, Any] = Field(default_factory=dict, description="laid over the architecture's tiny config")
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    probe: ProbeConfig = ProbeConfig()

    @model_validator(mode="after")
    def _one_source(self) -> HFModelConfig:
        if (self.path is None) == (self.architecture is None):
            raise ValueError("give exactly one of path (a checkpoint directory) or architecture (a tiny random model)")
        if self.architecture is not None and self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {sorted(ARCHITECTURES)}")
        if self.path is not None and self.config:
            raise ValueError("config applies to a random model (architecture), not to a checkpoint (path)")
        return self


class ReferenceModelConfig(ModelShape):
    """The project's reference MoE (:class:`eplb.model.ReferenceMoE`)."""

    kind: Literal["reference"] = "reference"


def _default_kind(value: Any) -> Any:
    # configs written before model kinds existed describe the reference model, as does a ModelShape
    if isinstance(value, dict) and "kind" not in value:
        return {**value, "kind": "reference"}
    if isinstance(value, ModelShape) and not isinstance(value, ReferenceModelConfig):
        return {**value.model_dump(), "kind": "reference"}
    return value


# the discriminated union inside, the default kind outside: the kind is filled in before the union looks at it
ModelSpec = Annotated[Annotated[ReferenceModelConfig | HFModelConfig, Field(discriminator="kind")],
                      BeforeValidator(_default_kind)]
