"""What a pipeline stage holds that a whole model does not, for the memory model: its own
layers and end pieces, and the micro-batches whose backward has not run yet.

A rank of a pipeline (Narayanan et al. 2021, arXiv 2104.04473) holds the blocks of its model
chunks (``model/stages.py``: earlier stages take the extra layer), the word embedding on the
first stage, the final norm and the output layer on the last (Megatron's copy of a tied
embedding there, or an untied output layer), and activations of every chunk-forward in flight
-- ``microbatches_in_flight``: 1F1B ``min(p - r, m)``, interleaved its warm-up plus one, AFAB
all m. So the first stage keeps the most activations and the last stage holds the head: the
model is asked about one stage (``Setup.pipeline_rank``) and the dry run compares each rank
with its own. Without a pipeline every function here gives the whole model's figure.
"""

from __future__ import annotations

from zerotron.estimate.stage3_memory import block_param_numels, norm_numels
from zerotron.model.stages import split_chunks
from zerotron.parallel.pipeline_schedules import microbatches_in_flight


def chunk_layers(setup) -> list[int]:
    """The layer count of each of this rank's model chunks (one chunk without interleaving)."""
    if setup.pp == 1:
        return [setup.model.num_layers]
    chunks = split_chunks(setup.model.num_layers, setup.pp, None, setup.virtual_stages)
    return [len(chunk) for chunk in chunks[setup.pipeline_rank]]


def stage_layers(setup) -> int:
    """Blocks this rank holds (all its chunks)."""
    return sum(chunk_layers(setup))


def holds_embedding(setup) -> bool:
    return setup.pipeline_rank == 0


def holds_head(setup) -> bool:
    return setup.pipeline_rank == setup.pp - 1


def end_param_numels(setup) -> list[int]:
    """The parameters outside the blocks on this rank: the word-embedding slice and a learned
    position table on the first stage; the final norm and the output layer (untied, or the tied
    embedding's copy when the first stage is another rank) on the last; none in the middle."""
    cfg, t = setup.model, setup.tp
    h, table = cfg.hidden_size, cfg.padded_vocab_size(t) * cfg.hidden_size // t
    out = []
    if holds_embedding(setup):
        learned = cfg.position_embedding_type == "learned"
        out += [table] + ([cfg.max_positions * h] if learned else [])
    if holds_head(setup):
        out += norm_numels(cfg, h) + ([table] if (not cfg.tied or setup.pp > 1) else [])
    return out


def stage_params(setup) -> int:
    """Ψ of this rank: its blocks and its end pieces (``end_param_numels``)."""
    block = sum(block_param_numels(setup.model, setup.tp))
    return stage_layers(setup) * block + sum(end_param_numels(setup))


def chunk_forwards_in_flight(setup) -> int:
    """Chunk-forwards whose backward has not run yet at the fullest moment of the schedule."""
    return microbatches_in_flight(setup.pipeline_schedule, setup.pp, setup.pipeline_rank,
                                  setup.microbatches, setup.virtual_stages)


def layers_in_flight(setup) -> int:
    """Layers whose activations are alive at once without checkpointing: each chunk-forward in
    flight keeps its chunk's layers (the largest chunk's, for interleaved ranks)."""
    if setup.pp == 1:
        return setup.model.num_layers
    return chunk_forwards_in_flight(setup) * max(chunk_layers(setup))


def checkpoints_alive(setup) -> int:
    """Checkpoints alive at once: every chunk-forward in flight keeps one per ``checkpoint_every``
    layers of its chunk. With MD they are slots of one buffer made at the first checkpoint and
    sized as ``training.parallelize.checkpointed_forwards_in_flight`` sizes it: whole-stage
    forwards of ceil(layers / k) checkpoints, rounded up for an interleaved rank."""
    k, chunks = setup.checkpoint_every, chunk_layers(setup)
    forwards = 1 if setup.pp == 1 else chunk_forwards_in_flight(setup)
    per_stage = -(-sum(chunks) // k)
    if len(chunks) == 1:
        return forwards * per_stage
    per_chunk = max(-(-n // k) for n in chunks)
    if setup.contiguous_memory and not setup.cpu_checkpointing:
        return -(-(forwards * per_chunk) // per_stage) * per_stage
    return forwards * per_chunk


def kept_input_bytes(setup, act_bytes: int) -> float:
    """The stage inputs the pipeline keeps beside the checkpoints: each received activation of a
    chunk-forward in flight stays referenced until its backward sends its gradient. It is the
    first checkpoint itself unless the checkpoint is a copy (MD's slot, Pa's slice, the host's);
    without checkpointing the first layer saves it anyway. A rank's very first chunk reads token
    ids, not an activation."""
    if setup.pp == 1 or not setup.checkpoint_activations:
        return 0.0
    pa = setup.partition_activations and setup.tp > 1 and not setup.sequence_parallel
    copied = setup.contiguous_memory or setup.cpu_checkpointing or pa
    if not copied:
        return 0.0
    cfg, t = setup.model, setup.tp
    sp = setup.sequence_parallel and t > 1
    forwards = chunk_forwards_in_flight(setup)
    received = forwards - (1 if holds_embedding(setup) and setup.virtual_stages == 1 else 0)
    if holds_embedding(setup) and setup.virtual_stages > 1:  # chunk 0's forwards read token ids
        received = forwards - min(forwards, _first_chunk_forwards(setup))
    sbh = setup.micro_batch * cfg.seq_length * cfg.hidden_size
    return received * sbh * act_bytes / (t if sp else 1)


def _first_chunk_forwards(setup) -> int:
    """Of an interleaved first rank's forwards in flight, those of its chunk 0 (the warm-up runs
    p micro-batches per chunk in turn)."""
    return min(setup.pp, setup.microbatches)
