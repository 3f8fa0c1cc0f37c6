"""Switches for tests and debugging only; nothing here changes what a run computes."""
