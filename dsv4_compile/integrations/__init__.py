"""Bridges from other DeepSeek V4 implementations to the layers of :mod:`dsv4_compile.models`."""
