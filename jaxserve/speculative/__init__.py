"""Speculative decoding: proposers of draft tokens (host side) and their configuration."""
