"""Fitting learned strategies to a target: they run the loop, so they sit above it."""
