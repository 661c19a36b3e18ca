"""How one collective is issued: argument routing, reduction semantics, side streams,
stages, the ``CommHandle`` it returns, and strict mode."""
