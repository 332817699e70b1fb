"""Capture router traces from Hugging Face MoE models (needs torch and transformers).

``routers`` finds the router modules per architecture, ``hooks`` records what they chose,
``capture`` runs the teacher-forced and generation loops, ``app`` is the moe-capture command.
"""
