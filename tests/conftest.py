"""Shared pytest fixtures for the strata test suite."""

import os

# Servers that the CLI starts in the background for a test's store exit soon
# after the test stops using them, so no test leaves a process behind for long.
os.environ.setdefault("STRATA_SERVER_IDLE_EXIT", "5")
