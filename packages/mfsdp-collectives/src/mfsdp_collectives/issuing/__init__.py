"""How one collective is issued: argument routing (``_op_args``), reduction semantics
(``_reduce``), side streams, its stages (``stages.issue_stages``), the ``CommHandle`` it
returns, and strict mode (``strict``)."""
