"""Helpers the test modules share: processes, launches, spec files, example models."""
