"""Two DistributedSampler pitfalls, shown without any process group.

A DistributedSampler takes the rank and the number of processes as arguments, so one
process can show what every rank would get. The troubleshooting page includes these
functions, and the guide's tests check what they return.
"""

from torch.utils.data import DistributedSampler


def epoch_orders(
    dataset_size: int, epochs: int, call_set_epoch: bool
) -> list[list[int]]:
    """The samples that rank 0 gets in each epoch, with or without set_epoch."""
    sampler = DistributedSampler(
        range(dataset_size), num_replicas=2, rank=0, shuffle=True
    )
    orders = []
    for epoch in range(epochs):
        if call_set_epoch:
            # The shuffle is seeded with seed + epoch: a new order each epoch.
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def samples_validated(dataset_size: int, world_size: int) -> int:
    """How many samples a validation over
    DistributedSampler shards counts, across all ranks."""
    return sum(
        len(
            list(
                DistributedSampler(range(dataset_size), world_size, rank, shuffle=False)
            )
        )
        for rank in range(world_size)
    )


def samples_validated_exactly(dataset_size: int, world_size: int) -> int:
    """The same, with the examples' strided shards: every
    world_size-th sample, no padding."""
    return sum(len(range(rank, dataset_size, world_size)) for rank in range(world_size))
