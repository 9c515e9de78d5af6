"""jaxserve"""
