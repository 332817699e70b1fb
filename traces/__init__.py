"""Router traces: the on-disk format, synthetic traces, importers, capture and the moe-trace CLI."""
