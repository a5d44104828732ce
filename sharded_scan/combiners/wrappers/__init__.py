"""Wrappers: a combiner run per key (``GroupBy``), weighted (``Weighted``), and the policies every run applies
(compensation, non-finite rows)."""
