"""Model presets: one MoE layer of a published model, as megatron-core TransformerConfig MoE fields, with the
source each value was read from. Torch-free: the CLI, the profiles and `moe-lab preflight` read it on the controller.

A preset becomes the lab's `MoEConfig` through `Preset.moe(scale=...)`. `scale` < 1 shrinks hidden and the expert /
shared-expert ffn (rounded to a multiple of 16), keeps the experts, top-k and the router's features, and labels the
layer as scaled everywhere (`MoEConfig.model`). What the lab cannot build of a model is said, never pretended:
`needs_te` (TransformerEngine-only paths: grouped GEMM, permute fusion — without TE megatron-core builds SequentialMLP)
and `left_out` (model features the lab's layer does not carry)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .config import MoEConfig

BRIDGE = "NVIDIA-NeMo/Megatron-Bridge"
MLM = "NVIDIA/Megatron-LM"


@dataclass(frozen=True)
class Preset:
    name: str
    """The preset's name on the command line (`--model`, `-p model=`)."""
    hidden: int
    heads: int
    """num_attention_heads (the TP check: heads % TP; the lab's layer has no attention of its own)."""
    num_experts: int
    topk: int
    ffn: int
    """moe_ffn_hidden_size: each routed expert's hidden size."""
    shared_ffn: int = 0
    score_function: str = "softmax"
    expert_bias: bool = False
    num_groups: int = 0
    group_topk: int = 0
    topk_scaling_factor: float = 0.0
    pre_softmax: bool = False
    moe_layers: str = ""
    """Which of the model's layers are MoE (the lab runs one, or a stack of them)."""
    production: dict = field(default_factory=dict)
    """What the model's Megatron configs set beyond the layer's shape (dispatcher, router dtype, fusions...)."""
    needs_te: tuple[str, ...] = ("moe_grouped_gemm", "moe_permute_fusion")
    """Settings of the production config that need TransformerEngine: the lab builds megatron's SequentialMLP and the
    unfused permute instead (the numerics of those paths are not measured here)."""
    left_out: tuple[str, ...] = ()
    """Features of the model that the lab's layer does not carry (said on every run of the preset)."""
    sources: tuple[str, ...] = ()
    """Where each value was read: repository, path @ commit, lines."""

    def moe(self, *, scale: float = 1.0, **changes) -> MoEConfig:
        """This preset's layer as a MoEConfig; `scale` in (0, 1] shrinks hidden and ffn (labelled)."""
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 0 < scale <= 1:
            raise ValueError(f"scale ({scale!r}) must be a number in (0, 1], e.g. 0.125")
        size = (lambda v: v) if scale == 1 else (lambda v: max(16, int(round(v * scale / 16)) * 16) if v else 0)
        label = self.name if scale == 1 else f"{self.name} x{scale:g} (scaled)"
        kw = dict(hidden=size(self.hidden), num_experts=self.num_experts, topk=self.topk, ffn_hidden=size(self.ffn),
                  shared_ffn=size(self.shared_ffn), score_function=self.score_function, expert_bias=self.expert_bias,
                  num_groups=self.num_groups, group_topk=self.group_topk, topk_scaling_factor=self.topk_scaling_factor,
                  pre_softmax=self.pre_softmax, gated=True, model=label)
        kw.update(changes)
        return MoEConfig(**kw)


_DSV3_PROVIDER = (f"{BRIDGE} src/megatron/bridge/models/deepseek/deepseek_provider.py "
                  "@ 4ab7b62b40eb0f43f51bb5a323082e6af18173de")
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("mixtral-8x7b", hidden=4096, heads=32, num_experts=8, topk=2, ffn=14336, moe_layers="32 of 32",
           production={"moe_token_dispatcher_type": "alltoall", "moe_aux_loss_coeff": 0.01},
           sources=(f"{MLM} examples/mixtral/train_mixtral_8x7b_distributed.sh @ d98e8a64ddf34856e74b24714e3bedb2f5a39553"
                    " l. 27-59 (--swiglu, --disable-bias-linear; pre-softmax unset = False: top-k on the logits, then "
                    "softmax over the k, as HF Mixtral's softmax-then-renormalise)",
                    "NVIDIA/NeMo nemo/collections/llm/gpt/model/mixtral.py @ d24cc776e874ed5b8f787365b574cdc0212f8c25 "
                    "MixtralConfig sets moe_router_pre_softmax=True: not taken here (its weights are not renormalised)")),
    Preset("qwen3-30b-a3b", hidden=2048, heads=32, num_experts=128, topk=8, ffn=768, moe_layers="48 of 48",
           production={"moe_token_dispatcher_type": "alltoall", "moe_router_dtype": "fp32 (Megatron-LM's conf)",
                       "moe_aux_loss_coeff": 0.001},
           sources=(f"{BRIDGE} src/megatron/bridge/models/qwen/qwen_provider.py @ "
                    "8c6c6534b9421228e14ddde4165686b536ca4f10 l. 363-411",
                    f"{MLM} examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh @ "
                    "d98e8a64ddf34856e74b24714e3bedb2f5a39553 l. 10-45")),
    Preset("qwen3-235b-a22b", hidden=4096, heads=64, num_experts=128, topk=8, ffn=1536, moe_layers="94 of 94",
           production={"moe_token_dispatcher_type": "alltoall", "moe_router_dtype": "fp32 (Megatron-LM's conf)",
                       "moe_aux_loss_coeff": 0.001},
           sources=(f"{BRIDGE} src/megatron/bridge/models/qwen/qwen_provider.py @ "
                    "8c6c6534b9421228e14ddde4165686b536ca4f10 l. 363-397, 414-425",
                    f"{MLM} examples/post_training/modelopt/conf/Qwen/Qwen3-235B-A22B.sh @ "
                    "d98e8a64ddf34856e74b24714e3bedb2f5a39553 l. 10-49")),
    Preset("deepseek-v3", hidden=7168, heads=128, num_experts=256, topk=8, ffn=2048, shared_ffn=2048,
           score_function="sigmoid", expert_bias=True, num_groups=8, group_topk=4, topk_scaling_factor=2.5,
           moe_layers="58 of 61 (the first 3 dense)",
           production={"moe_token_dispatcher_type": "alltoall", "moe_router_dtype": "fp32",
                       "moe_shared_expert_overlap": True, "moe_router_bias_update_rate": 0.001,
                       "moe_router_load_balancing_type": "seq_aux_loss"},
           needs_te=("moe_grouped_gemm", "moe_permute_fusion"),
           left_out=("moe_shared_expert_overlap (the lab runs the shared expert after the routed ones)",
                     "the expert bias's update during training (the lab seeds a fixed bias)"),
           sources=(_DSV3_PROVIDER + " l. 42-115 (base), 165-191 (V3)",
                    f"{BRIDGE} src/megatron/bridge/models/deepseek/deepseek_v3_bridge.py @ "
                    "067f987df03b8355b03192d88d70f1709fedf51a l. 53-97")),
    Preset("moonlight-16b-a3b", hidden=2048, heads=16, num_experts=64, topk=6, ffn=1408, shared_ffn=2816,
           score_function="sigmoid", expert_bias=True, num_groups=1, group_topk=1, topk_scaling_factor=2.446,
           moe_layers="26 of 27 (the first dense)",
           production={"moe_token_dispatcher_type": "alltoall", "moe_router_dtype": "fp32",
                       "moe_shared_expert_overlap": True, "moe_router_bias_update_rate": 0.001},
           left_out=("moe_shared_expert_overlap (the lab runs the shared expert after the routed ones)",
                     "the expert bias's update during training (the lab seeds a fixed bias)"),
           sources=(_DSV3_PROVIDER + " l. 194-229 (MoonlightModelProvider16B) with the base at l. 42-115",)),
    Preset("gpt-oss-20b", hidden=2880, heads=64, num_experts=32, topk=4, ffn=2880, moe_layers="24 of 24",
           production={"moe_token_dispatcher_type": "alltoall", "moe_router_dtype": "fp32 (Megatron-LM's conf)",
                       "add_bias_linear": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
                       "activation_func": "quick_gelu (quick-GeGLU)"},
           left_out=("quick-GeGLU with clamp 7.0 and linear offset 1.0 (the lab builds SwiGLU experts)",
                     "expert and router biases (add_bias_linear)"),
           sources=(f"{BRIDGE} src/megatron/bridge/models/gpt_oss/gpt_oss_provider.py @ "
                    "5fcab34f8bda72029a28e68979cc2f8a780d1f55 l. 38-84, 101-106",
                    f"{MLM} examples/post_training/modelopt/conf/openai/gpt-oss-20b.sh @ "
                    "d98e8a64ddf34856e74b24714e3bedb2f5a39553")),
)}


def get(name: str) -> Preset:
    """The preset called `name` (case-insensitive), or a ValueError listing the presets."""
    if not isinstance(name, str) or name.lower() not in PRESETS:
        raise ValueError(f"model ({name!r}) must be one of {', '.join(PRESETS)}")
    return PRESETS[name.lower()]


def moe_config(name: str, scale: float = 1.0, **changes) -> MoEConfig:
    return get(name).moe(scale=scale, **changes)


def as_dict(p: Preset) -> dict:
    return dataclasses.asdict(p)
