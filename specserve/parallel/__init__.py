"""Tensor parallelism: one model's weights sharded Megatron-style over N ranks (torch.distributed: gloo on CPU,
nccl on GPU), with speculation and the server on rank 0.

    shard.py    which heads, MLP columns and vocabulary each rank holds; slicing a loaded model into its shard
    group.py    the rendezvous (spawned ranks on one host, torchrun across hosts), build checks across ranks, the
                collectives: the deterministic sum of partials, the vocabulary gather, the command broadcast
    model.py    rank 0's TensorParallelModel: the target's forward interface over the ranks, and ShardedKVCache,
                a KV cache whose every change is replayed on the other ranks
    worker.py   the other ranks: load the same model, shard it, run the commands rank 0 broadcasts
    launch.py   starting the ranks (torch.multiprocessing on one host; torchrun's environment across hosts)

The engine, the drafters and the server do not know about ranks: rank 0's LoadedModel holds a TensorParallelModel
in place of its CausalLM. See docs/tensor-parallel.md.
"""
