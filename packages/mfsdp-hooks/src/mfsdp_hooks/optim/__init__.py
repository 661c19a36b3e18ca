"""Optimizer integration: the attached optimizer and the contiguous-chunk step."""
