"""Names of a Megatron-Core model chunk's tensors that do not depend on the parallel layout.

A pipeline stage numbers its ``decoder.layers`` from 0, and an expert-parallel rank its
``mlp.experts.local_experts`` from 0, so the same name means another tensor on another stage
or rank. The whole model's name of a layer is its ``layer_number - 1`` (Megatron-Core's
``TransformerLayer.layer_number`` counts from 1 across stages and virtual chunks), and of an
expert its entry in the ``MoELayer``'s ``local_expert_indices``. These are the names
Megatron-Core's own ``get_global_unique_param_name`` gives; at one stage and one expert rank
they are the chunk's own.

Names here are "bare": without the wrappers' ``module.`` levels.
"""

from __future__ import annotations

from torch import nn

from mfsdp_checkpoint import split_wrappers


class LayoutFreeNames:
    """The chunk's bare names <-> the whole model's, computed once from its modules."""

    def __init__(self, chunk: nn.Module) -> None:
        self._to_global: dict[str, str] = {}  # bare module path -> its last part, renumbered
        for name, module in chunk.named_modules():
            _, path = split_wrappers(name + ".")
            path = path[:-1]
            parent, _, last = path.rpartition(".")
            number = getattr(module, "layer_number", None)
            is_layer = parent.endswith("layers") and last.isdigit() and "mtp" not in path
            if is_layer and isinstance(number, int):
                self._to_global[path] = str(number - 1)
            indices = getattr(module, "local_expert_indices", None)
            if isinstance(indices, list) and hasattr(module, "experts"):
                for local, index in enumerate(indices):
                    self._to_global[f"{path}.experts.local_experts.{local}"] = str(index)
        # The inverse: each renamed module's whole-model path -> its chunk-local last part.
        self._to_local = {
            self._renamed(path, self._to_global): path.rpartition(".")[2]
            for path in self._to_global
        }

    @staticmethod
    def _renamed(path: str, table: dict[str, str]) -> str:
        """``path`` with every prefix found in ``table`` given its last part from there
        (prefixes are looked up as they read before renaming)."""
        parts = path.split(".")
        original, renamed = [], []
        for part in parts:
            original.append(part)
            renamed.append(table.get(".".join(original), part))
        return ".".join(renamed)

    def to_global(self, bare_name: str) -> str:
        return self._renamed(bare_name, self._to_global)

    def to_local(self, bare_name: str) -> str:
        """The inverse of :meth:`to_global` (prefixes looked up as they read globally)."""
        parts = bare_name.split(".")
        seen, local = [], []
        for part in parts:
            seen.append(part)
            local.append(self._to_local.get(".".join(seen), part))
        return ".".join(local)
