"""Runs in the controller process: `moe-lab`, its subcommands, and every line the package prints."""

from .main import build_parser, main

__all__ = ["main", "build_parser"]
