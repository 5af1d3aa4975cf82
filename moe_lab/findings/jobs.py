"""What a remedy is in a training job: config fields, environment, code (megatron options where they exist)."""

from __future__ import annotations

JOB_LINES = {
    "router fp32": ["TransformerConfig(moe_router_dtype=\"fp32\")  # Megatron-LM: --moe-router-dtype fp32"],
    "router fp64": ["TransformerConfig(moe_router_dtype=\"fp64\")  # Megatron-LM: --moe-router-dtype fp64"],
    "probs fp32 gather": ["# cast routing probs to fp32 before the token dispatcher (the reporter's patch; no megatron "
                          "option: prefer moe_router_dtype)"],
    "deterministic": ["torch.use_deterministic_algorithms(True)  # megatron's unpermute: scatter_add_ → index_add_",
                      "export NCCL_ALGO=Ring CUBLAS_WORKSPACE_CONFIG=:4096:8  # Megatron-LM: --deterministic-mode"],
    "no_splitk": ["torch.backends.cuda.preferred_blas_library(\"cublaslt\")",
                  "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)  # torch >= 2.10"],
    "ordered_combine": ["# replace megatron's token_dispatcher.unpermute by an ordered fp32 sum "
                        "(moe_lab.experiments.remedies.ordered_combine; no megatron option)"],
    "tiled_experts": ["# run every expert GEMM on fixed-size row tiles (moe_lab.experiments.remedies.tiled_experts)"],
    "padding_mask": ["moe_layer(hidden_states, padding_mask=mask)  # megatron's MoE padding mask"],
    "routing replay": ["TransformerConfig(moe_enable_routing_replay=True)  # replay the recorded routing in the "
                       "backward / recompute"],
    "fp32 grad reduce": ["# the backward's reduce-scatter of the token gradients in fp32 (moe_lab.questions.compound.experiment; "
                         "no megatron option)"],
    "batch_invariant_mode": ["from megatron.core.transformer.custom_layers.batch_invariant_kernels import "
                             "set_batch_invariant_mode",
                             "with set_batch_invariant_mode(True): ...  # Triton kernels for aten::mm/addmm (GPU)"],
}


def job_lines(setting: str, router_dtype: str | None = None) -> list[str]:
    """'router fp32 + deterministic' / 'ordered_combine+no_splitk' / 'batch_invariant_mode, router fp64' → the lines a
    training job needs. `router_dtype`: the router dtype the setting's records ran with — its line comes first where
    the setting's name does not say it (a remedy measured with moe_router_dtype=fp32 needs it in the job too)."""
    parts = [p.strip() for p in setting.replace("+", ",").split(",") if p.strip()]
    if router_dtype in ("fp32", "fp64") and f"router {router_dtype}" not in parts:
        parts.insert(0, f"router {router_dtype}")
    out = []
    for part in parts:
        if part == "router none":
            continue
        out += JOB_LINES.get(part, [f"# {part}"])
    return out


__all__ = ["JOB_LINES", "job_lines"]
