"""Fixtures of the cluster tier."""

import pytest

OTHER_RELEASE = "0.12.3"  # installed side by side (cached; notebook 03 uses it too)


@pytest.fixture(scope="session")
def other_release() -> tuple[str, ...]:
    """megatron-core 0.12.3 installed side by side (the step a run takes before it starts: `versions.prepare`), as
    the engines' extra sys.path."""
    from moe_lab.experiments import protocol
    from moe_lab.tools import versions

    versions.prepare([OTHER_RELEASE])
    return protocol.release_path(OTHER_RELEASE)
