"""The tools' own failure, torch-free so the CLI can catch it without importing torch."""


class InstallError(RuntimeError):
    """pip, or the release it installed, failed: no index, a timeout, a release that does not import. One line that
    names what was being installed; the CLI prints it and exits 3 (a failure, not bad input), the details in the log."""


__all__ = ["InstallError"]
