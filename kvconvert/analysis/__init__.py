"""``kvconvert analyze``: per-layer statistics that methods base their decisions on."""
