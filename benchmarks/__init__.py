"""The benchmark suite: commands that print tables of measured figures."""
