"""Importers of foreign trace formats into the trace format (``traces.format``)."""
