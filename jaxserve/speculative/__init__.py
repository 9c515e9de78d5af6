"""Speculative decoding: proposers of draft tokens (host side); configured by
`jaxserve.config.speculative_config.SpeculativeConfig`."""
