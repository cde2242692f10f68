"""Communication between stages: transport, links, process groups, NCCL's ordering, status and the batch feed."""
