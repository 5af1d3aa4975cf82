"""What each megatron-core release has, torch-free: the releases the lab builds per Python, version
parsing and detection, the first release of each option and feature, and `check_config` — the one place a layer config
is checked against a release, on the controller before an engine runs it. The engine side (shims, building a
MoELayer) is `engine/compat.py`; nothing here imports torch or megatron-core (a version is read from package
metadata when megatron-core is not imported yet)."""

from __future__ import annotations

import re
import sys
import warnings

# Releases the lab builds layers for, by Python: the local (no-TE) MoE spec changed shape in 0.19.
SUPPORTED = {(3, 11): ("0.11", "0.16"), (3, 12): ("0.11", "0.19"), (3, 13): ("0.17", "0.19")}
ROUTER_DTYPE_SINCE = (0, 12, 0)  # `moe_router_dtype` first ships in 0.12.0


def parse_version(v: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:[.\-+]?\w+)*", v.strip())
    if not m:
        raise ValueError(f"megatron-core version ({v!r}) must look like X.Y.Z, e.g. 0.16.1")
    return tuple(int(x) for x in m.groups())  # type: ignore[return-value]


def normalize_version(v: str) -> str:
    """'0.12.3' for '0.12.3' / ' 0.12.3 ' (checked): the form engines report in results."""
    return ".".join(map(str, parse_version(v)))


def installed_version() -> str:
    """The megatron-core release that `import megatron.core` loads here (sys.path order respected). Read from the
    package metadata beside the package when it is not imported yet (the import takes seconds: the controller only
    needs the number)."""
    if "megatron.core" not in sys.modules:
        v = _metadata_version()
        if v:
            return v
    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": known, and said in the README
            warnings.filterwarnings("ignore", message=".*Transformer Engine.*", category=UserWarning)
            import megatron.core as mc
    except ImportError as e:
        raise RuntimeError("megatron-core is not importable: `pip install megatron-core` or `moe-lab versions install X.Y.Z`") from e
    v = getattr(mc, "__version__", None)
    if v is None:
        from megatron.core import package_info

        v = package_info.__version__
    return str(v)


def _metadata_version() -> str | None:
    import importlib.metadata
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    root = Path(spec.origin).resolve().parents[2]  # <site>/megatron/core/__init__.py → <site>
    for d in importlib.metadata.distributions(path=[str(root)]):
        if (d.metadata["Name"] or "").lower().replace("_", "-") == "megatron-core":
            return str(d.version)
    return None


def check_supported(version: str, python: tuple[int, int] | None = None) -> None:
    """Raise ValueError if the lab has no layer builder for this release on this Python."""
    py = python or sys.version_info[:2]
    rng = SUPPORTED.get(tuple(py))
    vt = parse_version(version)
    if rng is None:
        raise ValueError(f"Python {py[0]}.{py[1]} is not supported; use 3.11 (megatron-core 0.11–0.16) or 3.12")
    lo, hi = (parse_version(x + ".0") for x in rng)
    if not (lo[:2] <= vt[:2] <= hi[:2]):
        raise ValueError(f"megatron-core {version} is not supported on Python {py[0]}.{py[1]}: the lab builds {rng[0]}–{rng[1]}")


def supports_router_dtype(version: str) -> bool:
    return parse_version(version) >= ROUTER_DTYPE_SINCE


def check_router_dtype(router_dtype: str, version: str) -> None:
    if router_dtype != "none" and not supports_router_dtype(version):
        raise ValueError(
            f"router_dtype ({router_dtype!r}) needs megatron-core >= 0.12.0 (moe_router_dtype); "
            f"{version} only allows 'none'"
        )


OPTIONS_SINCE = {"moe_permute_fusion": (0, 11, 0), "moe_router_fusion": (0, 14, 0),
                 "moe_enable_routing_replay": (0, 16, 0)}
"""First release with each TransformerConfig option the lab turns on (release notes)."""


FEATURE_FIELDS = {"score_function": "moe_router_score_function", "pre_softmax": "moe_router_pre_softmax",
                  "expert_bias": "moe_router_enable_expert_bias", "num_groups": "moe_router_num_groups",
                  "group_topk": "moe_router_group_topk", "topk_scaling_factor": "moe_router_topk_scaling_factor",
                  "shared_ffn": "moe_shared_expert_intermediate_size", "gated": "gated_linear_unit",
                  "capacity_factor": "moe_expert_capacity_factor", "drop_policy": "moe_token_drop_policy",
                  "pad_to_capacity": "moe_pad_expert_input_to_capacity"}
"""MoEConfig's router/expert features → the TransformerConfig field each one sets (config.ROUTER_FEATURES). Every
one of these fields is in every release the lab builds (read in the tags core_v0.11.0 … core_v0.19.0)."""
FEATURE_VALUE_SINCE = {("score_function", "sqrtsoftplus"): (0, 18, 0)}
"""Values of a feature that a later release added (the score function 'sqrtsoftplus' ships in core_v0.18.0)."""


def check_config(cfg, version: str) -> None:
    """Everything about a MoEConfig that depends on the megatron-core release: the one place that checks a config
    against a release (controller side, before an engine runs it; ValueError naming the field)."""
    check_router_dtype(cfg.router_dtype, version)
    for opt in getattr(cfg, "options", ()):
        if parse_version(version) < OPTIONS_SINCE[opt]:
            raise ValueError(f"options ({opt!r}) needs megatron-core >= {'.'.join(map(str, OPTIONS_SINCE[opt]))}; "
                             f"this is {version}")
    for (field, value), since in FEATURE_VALUE_SINCE.items():
        if getattr(cfg, field, None) == value and parse_version(version) < since:
            raise ValueError(f"{field} ({value!r}) needs megatron-core >= {'.'.join(map(str, since))}; "
                             f"this is {version}")
