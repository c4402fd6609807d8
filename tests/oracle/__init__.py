"""Independent float64 NumPy reference ("oracle") for embtables, written from docs/spec.md, sections 1, 2 and 10."""
