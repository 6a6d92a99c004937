"""What holds memory: records of tensors and snapshots, the census that finds and names storages,
reachability, and the per-cell watch. Knows nothing of displays or magics."""
