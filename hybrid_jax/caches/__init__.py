"""The caches a forward runs over (`base.Cache`): dense per-sequence for research use and HF parity, paged KV +
state slots for the engine's steps, and the fused single-device decode path over the same pools."""
