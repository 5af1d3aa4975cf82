"""Typed findings: records → `Finding`s, the one source of every verdict, card, README line and CLI answer.
Torch-free: `moe-lab findings REPORT_DIR` reads a report's results.json without engines or torch."""

from .model import FAIL, MIXED, NA, NOT_MEASURED, PASS, STATUSES, Cost, Count, Evidence, Finding  # noqa: F401
from .render import headline  # noqa: F401

