"""Checks of the series itself: ``make gpu-check`` and the real runs the tests share with it. Nothing here is taught."""
