"""Converters from the papers' authors' released checkpoints into this project's checkpoint format."""
