"""A strided tensor-parallel partition (Megatron-Core's ``partition_stride``: a SwiGLU
``linear_fc1`` holds ``[w_r; v_r]`` of the global ``[w; v]`` on TP rank ``r``): where a
rank's rows go in the checkpoint, how the whole tensor is put back together over TP, and the
split Megatron-LM saves it as (``_w``/``_v``). End to end (training, resuming across TP) in
``tests/test_mcore_parallelism.py`` under ``nox -s mcore``."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from mfsdp_checkpoint.chunks import RowChunk
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import TPSpec, tp_full_tensor

ROWS, COLS = 8, 3  # global [w; v], w and v 4 rows each; 2 TP ranks: 4 local rows, 2 blocks


def test_a_ranks_rows_of_a_strided_partition_go_to_each_blocks_place() -> None:
    # TP rank 1 of 2 holds [w_1; v_1] = global rows 2-3 and 6-7; its DP shard is local rows
    # 1..3, i.e. the second row of w_1 and the first of v_1.
    chunk = RowChunk(torch.Size([ROWS, COLS]), 1, 3, True, (2, 0), torch.Size([4, COLS]), stride=2)
    pieces = [(tuple(s.offsets), tuple(s.sizes), start, end) for s, start, end in chunk.pieces()]
    assert pieces == [((3, 0), (1, COLS), 0, 1), ((6, 0), (1, COLS), 1, 2)]
    assert RowChunk(torch.Size([ROWS, COLS]), 2, 2, False, (2, 0), None, 2).pieces() == []


def _gather(rank: int, world: int) -> bool:
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    w, v = full.chunk(2)
    local = torch.cat([w.chunk(world)[rank], v.chunk(world)[rank]])
    spec = TPSpec(mesh, (Shard(0),), full.shape, (rank * 2, 0), False, partition_stride=2)
    return torch.equal(tp_full_tensor(local, spec), full)


def test_the_whole_tensor_of_a_strided_partition_is_every_ranks_blocks_in_place() -> None:
    assert run_distributed(_gather, 2, timeout=120) == [True, True]
