"""Reliability suites: kills, server faults and bad inputs (see __main__.py)."""
