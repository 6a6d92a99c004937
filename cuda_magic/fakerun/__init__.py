"""Predicting a cell's memory before running it: the cell runs on fake tensors (no storage) with fake copies
of the namespace's modules and optimizers, nothing of it stays, and the device is not touched."""
