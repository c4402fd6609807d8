"""Independent float64 NumPy reference ("oracle") for embtables, written from SPEC sections 1, 2 and 10."""
