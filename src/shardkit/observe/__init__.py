"""Seeing what happened: communication accounting, memory, timelines, traces, plots."""
