"""Tensor parallelism's machinery apart from the model (issue 42): the ranks of a replica, how rank 0 drives them each
step and how they sum their partial results.

* ``shm.py``: shared memory regions and the wait every channel here uses (spin briefly, then back off to sleeping,
  so an idle replica burns no core; a dead peer or a parent gone ends the wait with an error).
* ``collectives.py``: all-reduce, gather to rank 0, broadcast from rank 0 and a minimum, over shared memory for CPU
  ranks on one node (gloo's took ~1 ms an all-reduce here), or over a ``torch.distributed`` process group (NCCL).
* ``step_channel.py``: rank 0's step messages to the others, a one-writer, many-reader queue in shared memory; a
  step carries only the block-table entries that changed.
* ``ranks.py``: starting the rank workers, their loop (the model runner's own ``launch`` with no sampler), liveness
  and shutdown.

The model's cut is a transform of its definition: ``engine.models.tensor_parallel``.
"""
