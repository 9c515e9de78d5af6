"""The request loop and request state: `LLMEngine.step()`, the async engine a server drives, request groups
(n / best_of samples, beams), detokenization, request checks, structured outputs and chat templates."""
