"""Around the lab: the bench, the scale plan, megatron-core releases side by side, offline wheel sets."""
