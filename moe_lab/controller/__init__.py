"""Runs in the controller process (a notebook kernel or the CLI): the cluster of engines and what it knows about them."""
