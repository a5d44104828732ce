"""Wrappers: a combiner run per key (``GroupBy``), weighted (``Weighted``), per column (``EachColumn``), and the
policies every run applies (compensation, non-finite rows)."""
