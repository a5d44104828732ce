"""Sketches: approximate (or, asked, exact) quantiles, distinct counts and top-k in bounded memory, their keys and
DataSketches' bytes."""
