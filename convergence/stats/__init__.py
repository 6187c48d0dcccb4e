"""Verdicts: how a test curve is judged against a control curve (or a band of replicates)."""
