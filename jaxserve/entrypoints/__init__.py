"""Entry points: the `jaxserve` command line (and, later, the HTTP server)."""
