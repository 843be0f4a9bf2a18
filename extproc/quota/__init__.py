"""Quota backends: one interface, a Redis implementation and an in-memory one."""
