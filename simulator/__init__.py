"""Discrete-event simulator of MoE expert offloading driven by router traces."""
