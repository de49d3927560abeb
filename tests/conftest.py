"""Shared pytest fixtures for the strata test suite."""
