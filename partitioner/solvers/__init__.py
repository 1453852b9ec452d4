"""Placement solvers."""
