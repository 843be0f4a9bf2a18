"""Request-side decisions: who is calling, what they ask for, and whether quota admits it."""
