"""Weights streamed block by block through a ring of slots: the streamer, its slot pool, the
training and frozen-base streams. See README.md beside this file."""
