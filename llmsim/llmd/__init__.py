"""``ext-compat: llm-d-v0.10.2``: answer as llm-d-inference-sim v0.10.2 does on the wire.

Written from a reading of the real simulator's source at that tag (no code or text copied):
its dummy tokenizer and chat prompt rendering (``tokenizer``), its random answers
(``answers``), request parsing and validation (``request``), random tool calls (``tools``),
response and chunk shapes (``wire``) and the request life cycle (``frontend``).
Differences kept on purpose are listed in ``docs/simulator.md``.
"""
