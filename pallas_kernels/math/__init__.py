"""The math the kernels' references and the model's layers share, in pure JAX: the gated delta rule, GDN's conv
and L2 norm, RMS norms, RoPE and the attention output gate."""
