"""moe_lab's version (the package's `__version__`; provenance records it): a module of its own, so that reading it
imports nothing else of the package."""

__version__ = "0.2.0"
