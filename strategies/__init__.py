"""Parallel training strategies (``strategy="gem5d"``): sparse 2D embedding sharding x dense 3D."""
