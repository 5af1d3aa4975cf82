"""Unit tests for moe_lab.config: every bad input is refused up front, with a message naming field and value."""

from __future__ import annotations

import dataclasses

import pytest

from moe_lab.config import ClusterConfig, MoEConfig
from moe_lab.layout import WORLD, Layout

# --------------------------------------------------------------------------------------------------
# MoEConfig: valid configs
# --------------------------------------------------------------------------------------------------


def test_moe_defaults_valid():
    """The defaults construct and are the small CPU-sized layer."""
    c = MoEConfig()
    assert (c.hidden, c.num_experts, c.topk, c.ffn_hidden, c.seq_len) == (256, 8, 4, 512, 128)
    assert (c.dtype, c.dispatcher, c.router_dtype) == ("bf16", "allgather", "none")
    assert not {"tp", "ep", "etp", "sequence_parallel"} & set(c.asdict())  # the layout lives on the case


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(topk=8),                          # topk == num_experts is allowed
        dict(topk=1, pre_softmax=True),     # megatron: top-1 softmax routing needs pre-softmax
        dict(dtype="fp16", dispatcher="alltoall", router_dtype="fp32"),
        dict(dtype="fp32", router_dtype="fp64", deterministic=True),
    ],
)
def test_moe_valid_edge_configs(kwargs):
    """Boundary values that are legal must not be refused."""
    c = MoEConfig(**kwargs)
    for k, v in kwargs.items():
        assert getattr(c, k) == v


def test_moe_seed_report():
    """seed_report() is Megatron-LM #1421's config: hidden 4096, 64 experts, top-6, 1024 tokens, ffn 16384, bf16."""
    c = MoEConfig.seed_report()
    assert c.hidden == 4096
    assert c.num_experts == 64
    assert c.topk == 6
    assert c.seq_len == 1024
    assert c.ffn_hidden == 16384
    assert c.dtype == "bf16"
    # Everything else stays at the class defaults.
    assert (c.dispatcher, c.router_dtype, c.seed) == ("allgather", "none", 123)


def test_moe_seed_report_overrides():
    """Overrides replace seed-report values and are validated like any other input."""
    c = MoEConfig.seed_report(dispatcher="alltoall", seq_len=16)
    assert (c.dispatcher, c.seq_len, c.hidden) == ("alltoall", 16, 4096)
    with pytest.raises(ValueError, match=r"topk \(65\).*num_experts \(64\)"):
        MoEConfig.seed_report(topk=65)


def test_moe_frozen():
    """Configs are frozen: assigning a field raises, and the value stays."""
    c = MoEConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden = 512  # type: ignore[misc]
    assert c.hidden == 256


def test_moe_keyword_only():
    """Fields are keyword-only, so a positional argument cannot silently land in the wrong field."""
    with pytest.raises(TypeError):
        MoEConfig(256)  # type: ignore[misc]


def test_moe_replace_revalidates():
    """replace() returns a new, checked config and leaves the original untouched."""
    c = MoEConfig()
    d = c.replace(topk=2)
    assert d.topk == 2 and c.topk == 4
    with pytest.raises(ValueError, match=r"topk \(9\)"):
        c.replace(topk=9)


def test_moe_asdict_roundtrip_and_hash():
    """asdict() round-trips through the constructor; equal configs are equal and hash alike."""
    c = MoEConfig.seed_report(seed=8)
    d = c.asdict()
    assert d["hidden"] == 4096 and d["seed"] == 8
    assert MoEConfig(**d) == c
    assert hash(MoEConfig(**d)) == hash(c)


# --------------------------------------------------------------------------------------------------
# MoEConfig: bad inputs
# --------------------------------------------------------------------------------------------------

BAD_MOE = [
    # (kwargs, substrings the message must contain: field name and offending value)
    pytest.param(dict(num_experts=8, topk=9), ["topk (9)", "num_experts (8)"], id="topk-gt-experts"),
    pytest.param(dict(dispatcher="alltoallv"), ["dispatcher", "'alltoallv'"], id="unknown-dispatcher"),
    pytest.param(dict(dispatcher="AllGather"), ["dispatcher", "'AllGather'"], id="dispatcher-case"),
    pytest.param(dict(router_dtype="bf16"), ["router_dtype", "'bf16'"], id="unknown-router-dtype"),
    pytest.param(dict(router_dtype=None), ["router_dtype", "None"], id="router-dtype-None"),
    pytest.param(dict(dtype="bfloat16"), ["dtype", "'bfloat16'"], id="unknown-dtype"),
    pytest.param(dict(dtype="fp64"), ["dtype", "'fp64'"], id="dtype-fp64"),
    pytest.param(dict(hidden=0), ["hidden (0)"], id="hidden-zero"),
    pytest.param(dict(hidden=-256), ["hidden (-256)"], id="hidden-negative"),
    pytest.param(dict(num_experts=0, topk=0), ["num_experts (0)"], id="experts-zero"),
    pytest.param(dict(topk=0), ["topk (0)"], id="topk-zero"),
    pytest.param(dict(ffn_hidden=0), ["ffn_hidden (0)"], id="ffn-zero"),
    pytest.param(dict(seq_len=-5), ["seq_len (-5)"], id="seq-negative"),
    pytest.param(dict(hidden=True), ["hidden (True)"], id="hidden-bool"),
    pytest.param(dict(topk=True), ["topk (True)"], id="topk-bool"),
    pytest.param(dict(hidden=256.0), ["hidden (256.0)"], id="hidden-float"),
    pytest.param(dict(seq_len="128"), ["seq_len ('128')"], id="seq-str"),
]


@pytest.mark.parametrize("kwargs, needles", BAD_MOE)
def test_moe_bad_input_names_field_and_value(kwargs, needles):
    """Each invalid input raises ValueError whose message names the field and the offending value."""
    with pytest.raises(ValueError) as exc:
        MoEConfig(**kwargs)
    msg = str(exc.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_moe_has_no_layout_fields():
    """The layout is not the layer's: tp / ep / etp / sequence_parallel are refused as MoEConfig fields (a case's
    `Layout` holds them)."""
    for name in ("tp", "ep", "etp", "sequence_parallel"):
        with pytest.raises(TypeError, match=name):
            MoEConfig(**{name: 1})


# --------------------------------------------------------------------------------------------------
# A case's layout on a world: Layout.on (ep 0 = the whole world) and Layout.check_layer
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ep, tp, world, expected",
    [
        (0, 1, 8, 8),   # ep=0 → world / tp
        (0, 2, 8, 4),
        (0, 1, 1, 1),
        (2, 2, 4, 2),   # explicit ep, ep * tp == world
        (4, 1, 4, 4),
        (8, 1, 8, 8),
        (2, 1, 4, 2),   # explicit ep below the world: the other ranks are expert-data-parallel (edp 2)
        (1, 1, 4, 1),   # EP=1 on 4 ranks: data parallel only
    ],
)
def test_layout_on_world_ok(ep, tp, world, expected):
    """Layout.on resolves EP when the world is a multiple of tp and of etp x ep, and the layer's experts divide."""
    lay = Layout(tp=tp, ep=ep).on(world)
    lay.check_layer(MoEConfig())
    assert lay.ep == expected and lay.resolved and lay.tp == tp


@pytest.mark.parametrize(
    "ep, tp, world, needles",
    [
        (8, 1, 4, ["world (4)", "etp x ep", "1 x 8"]),      # explicit ep larger than the world
        (4, 2, 4, ["world (4)", "etp x ep", "2 x 4"]),      # etp (= tp) x ep overshoots
        (0, 2, 3, ["world (3)", "multiple of tp (2)"]),     # world not divisible by tp
        (0, 1, 3, ["num_experts (8)", "ep (3)"]),            # 8 experts over 3 ranks
        (0, 1, 16, ["num_experts (8)", "ep (16)"]),          # more EP ranks than experts
    ],
)
def test_layout_on_world_errors(ep, tp, world, needles):
    """A world that is not a multiple of tp and of etp x ep, or experts not divisible by ep, raises ValueError."""
    with pytest.raises(ValueError) as exc:
        Layout(tp=tp, ep=ep).on(world).check_layer(MoEConfig())
    for needle in needles:
        assert needle in str(exc.value), f"{needle!r} not in {str(exc.value)!r}"


@pytest.mark.parametrize("world", [0, -8, 2.0, True])
def test_layout_on_non_positive_world(world):
    """A world of <= 0 ranks (or not an integer) is not a world: ValueError, not ZeroDivisionError or a negative
    EP."""
    with pytest.raises(ValueError, match="world"):
        WORLD.on(world)


@pytest.mark.parametrize("layout, layer, needles", [
    (Layout(tp=3), MoEConfig(hidden=256), ["hidden (256)", "tp (3)"]),
    (Layout(tp=8), MoEConfig(hidden=256, ffn_hidden=100), ["ffn (100)", "etp (8)"]),
    (Layout(tp=2, ep=2, etp=4), MoEConfig(ffn_hidden=510), ["ffn (510)", "etp (4)"]),
    (Layout(ep=3), MoEConfig(), ["num_experts (8)", "ep (3)"]),
    (Layout(tp=4, sequence_parallel=True), MoEConfig(seq_len=6), ["seq_len (6)", "tp (4)"]),
])
def test_layout_refuses_a_layer_it_cannot_split(layout, layer, needles):
    """Layout.check_layer names the first rule a layer breaks under the layout, with its numbers."""
    with pytest.raises(ValueError) as exc:
        layout.check_layer(layer)
    for needle in needles:
        assert needle in str(exc.value), f"{needle!r} not in {str(exc.value)!r}"


def test_whole_world_layout_reads_as_such():
    """ep 0 is 'the whole world' until resolved: its spec parses back, and its words say so."""
    assert Layout.parse(WORLD.spec()) == WORLD and WORLD.spec() == "epall" and "all" in WORLD.label()
    assert not WORLD.resolved and Layout.parse("tp2,epall") == Layout(tp=2, ep=0)
    with pytest.raises(ValueError, match="positive integer"):
        Layout.parse("ep0")


# --------------------------------------------------------------------------------------------------
# ClusterConfig
# --------------------------------------------------------------------------------------------------


def test_cluster_defaults_valid():
    """Defaults construct: 4 CPU engines, positive timeouts, empty path/env; no layout (a case's own)."""
    c = ClusterConfig()
    assert (c.device, c.engines) == ("cpu", 4) and not hasattr(c, "tp")
    assert c.timeout_s > 0 and c.start_timeout_s > 0
    assert c.extra_path == () and c.env == ()


@pytest.mark.parametrize(
    "kwargs",
    [dict(device="cuda", engines=8), dict(engines=1), dict(engines=6), dict(timeout_s=1.5)],
)
def test_cluster_valid(kwargs):
    """Legal combinations are accepted as given."""
    c = ClusterConfig(**kwargs)
    for k, v in kwargs.items():
        assert getattr(c, k) == v


BAD_CLUSTER = [
    pytest.param(dict(device="gpu"), ["device", "'gpu'"], id="unknown-device"),
    pytest.param(dict(device="CUDA"), ["device", "'CUDA'"], id="device-case"),
    pytest.param(dict(engines=0), ["engines (0)"], id="engines-zero"),
    pytest.param(dict(engines=True), ["engines (True)"], id="engines-bool"),
    pytest.param(dict(engines=4.0), ["engines (4.0)"], id="engines-float"),
    pytest.param(dict(timeout_s=0), ["timeout_s (0)"], id="timeout-zero"),
    pytest.param(dict(timeout_s=-1.0), ["timeout_s (-1.0)"], id="timeout-negative"),
    pytest.param(dict(timeout_s=float("nan")), ["timeout_s (nan)"], id="timeout-nan"),
    pytest.param(dict(start_timeout_s=0.0), ["start_timeout_s (0.0)"], id="start-timeout-zero"),
    pytest.param(dict(timeout_s=0.5), ["timeout_s (0.5)", ">= 1"], id="timeout-under-a-second"),
]


@pytest.mark.parametrize("kwargs, needles", BAD_CLUSTER)
def test_cluster_bad_input_names_field_and_value(kwargs, needles):
    """Each invalid cluster input raises ValueError naming the field and value."""
    with pytest.raises(ValueError) as exc:
        ClusterConfig(**kwargs)
    msg = str(exc.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_cluster_frozen_and_replace():
    """ClusterConfig is frozen; replace() re-validates."""
    c = ClusterConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.engines = 8  # type: ignore[misc]
    assert c.replace(engines=8).engines == 8
    with pytest.raises(ValueError, match=r"engines \(0\)"):
        c.replace(engines=0)


def test_the_cut_rule_is_one_function_used_by_every_entry_point():
    """Check_cut states the truncation rule once; profiles, the protocol, the CLI, the layer and the scale tools
    all raise its message (the control: a valid cut passes through)."""
    import inspect

    from moe_lab import config, profiles
    from moe_lab.cli import probe as cli_probe
    from moe_lab.engine import layer
    from moe_lab.experiments import protocol
    from moe_lab.tools import scale, scale_measure

    assert config.check_cut(90, 128) == 90
    for bad in (0, 128, -1, True, 1.5, "90"):
        with pytest.raises(ValueError, match=r"must be an integer in 1..seq_len-1 \(127\)"):
            config.check_cut(bad, 128)
    for mod in (profiles, cli_probe, layer, protocol, scale, scale_measure):
        src = inspect.getsource(mod)
        assert "check_cut(" in src and "1..seq" not in src, mod.__name__
