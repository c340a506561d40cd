"""Gradients leaving the device during backward: where they land (landing), where they are
kept (storage) and how they travel (transport). See README.md beside this file."""
