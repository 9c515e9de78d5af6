"""Speculative decoding: proposers of draft tokens (host side); configured by `jaxserve.config.SpeculativeConfig`."""
