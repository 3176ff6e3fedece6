"""Charon."""
