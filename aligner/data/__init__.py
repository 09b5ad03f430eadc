"""Data sets, collation and sampling for training."""
