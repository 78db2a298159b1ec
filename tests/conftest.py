"""Session-wide test set-up."""

from tests._harness import close_all


def pytest_sessionfinish(session, exitstatus):
    """Stop the rank pools when the session ends, so no worker outlives pytest."""
    close_all()
